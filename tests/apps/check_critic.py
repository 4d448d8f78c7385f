"""ppo_train with a critic of its own (critic.shared false) on the demo's task: two steps from the policy, the
memory plan's critic lines, value_loss and critic_grad_norm logged each step, then the checkpoint's critic/
loaded by transformers' AutoModelForTokenClassification with no missing, unexpected or mismatched tensor, one
label and a trained (non-zero) head. (The values' arithmetic against transformers is test_critic's, on folders
transformers saves.) Refused with exit code 2 before training, naming the key: a critic folder (critic.init
path) whose vocabulary is smaller than the policy's tokenizer, a reward_model start with no
reward.model_path, a missing folder.

usage: check_critic.py PPO_TRAIN SOURCE_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForTokenClassification

from checks import expect, finish

ppo, src = sys.argv[1:3]
tiny = os.path.join(src, "configs", "ppo_tiny.yaml")
def run(tmp, name, *sets):
    args = ["--config", tiny, "--set", "sft.steps=0", "--set", "train.prompts_per_step=2",
            "--set", "sampling.samples_per_prompt=4", "--set", "train.steps=2", "--set", "train.eval_prompts=0",
            "--set", "critic.shared=false", "--set", "critic.lr=0.01", "--out", os.path.join(tmp, name)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run([ppo] + args, cwd=tmp, capture_output=True, text=True, timeout=600)


with tempfile.TemporaryDirectory() as tmp:
    p = run(tmp, "run")
    expect(f"ppo_train: exit {p.returncode}", p.returncode == 0, p.stdout + p.stderr)
    expect("the memory plan counts the critic", "critic " in p.stderr and "critic grads" in p.stderr, p.stderr)
    rows = []
    if p.returncode == 0:
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    expect("two steps", len(rows) == 2)
    for r in rows:
        expect(f"step {r.get('step')}: value_loss and critic_grad_norm logged",
               "value_loss" in r and r.get("critic_grad_norm", 0) > 0, json.dumps(r))
    folder = os.path.join(tmp, "run", "checkpoint", "critic")
    if os.path.isdir(folder):
        model, info = AutoModelForTokenClassification.from_pretrained(folder, output_loading_info=True,
                                                                      dtype=torch.float32)
        for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            expect(f"transformers loads critic/: {k} {info[k]}", not info[k])
        expect("one label", model.config.num_labels == 1)
        expect("a token-classification class", model.config.architectures[0].endswith("ForTokenClassification"))
        with torch.no_grad():
            out = model.eval()(input_ids=torch.tensor([[5, 17, 3, 9, 2, 40]])).logits
        expect("values (1, 6, 1)", tuple(out.shape) == (1, 6, 1))
        expect("the trained head is not zero", out.abs().max().item() > 0)
    else:
        expect("checkpoint/critic exists", False, p.stderr)

    # A critic folder of a smaller vocabulary than the policy's tokenizer (the demo's 400 pieces).
    small = os.path.join(tmp, "small")
    os.makedirs(small)
    with open(os.path.join(small, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "architectures": ["LlamaForTokenClassification"],
                   "id2label": {"0": "LABEL_0"}, "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}, f)
    for name, sets, key in [("small", ["critic.init=path", "critic.path=" + small], "critic.path"),
                            ("no_rm", ["critic.init=reward_model"], "critic.init"),
                            ("missing", ["critic.init=path", "critic.path=" + os.path.join(tmp, "nowhere")],
                             "critic.path")]:
        q = run(tmp, name, *sets)
        expect(f"{name}: exit 2", q.returncode == 2, q.stderr)
        expect(f"{name}: names {key}", key in q.stderr, q.stderr)
        expect(f"{name}: refused before training", not os.path.exists(os.path.join(tmp, name, "metrics.jsonl")))

finish("critic: trained, saved as a token-classification folder transformers loads; bad critics refused")
