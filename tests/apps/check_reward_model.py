"""grpo_train with a reward model beside the boxed matcher: the demo's policy and tokenizer, and a tiny
Qwen3ForSequenceClassification over Qwen3's published tokenizer and chat template (made by
tests/rollout/reward_model_reference.py: the reward model's vocabulary is not the policy's).
reward.combine = [{kind: boxed_tool_shaping, weight: 1}, {kind: model, weight: 0.5}]. Checked: every step
logs both terms and time_reward_s, reward_mean is 1 x the matcher's mean + 0.5 x the model's (the weights
swapped, the twin, must not match), the memory plan prints the reward model's line; a folder without a
tokenizer, and one whose head is not a score head, are refused before training with exit code 2, naming
reward.model_path.

usage: check_reward_model.py GRPO_TRAIN SOURCE_DIR REWARD_MODEL_REFS
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

from checks import expect, finish

grpo, src, refs = sys.argv[1:4]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
chat = os.path.join(refs, "qwen3_chat")
def run(tmp, name, model_path):
    args = ["--config", tiny, "--set", "sft.steps=0", "--set", "train.prompts_per_step=2",
            "--set", "sampling.samples_per_prompt=4", "--set", "train.steps=2", "--set", "train.eval_prompts=0",
            "--set", "train.checkpoint_every=0",
            "--set", "reward.combine=[{kind: boxed_tool_shaping, weight: 1}, {kind: model, weight: 0.5}]",
            "--set", "reward.model_path=" + model_path, "--out", os.path.join(tmp, name)]
    return subprocess.run([grpo] + args, cwd=tmp, capture_output=True, text=True, timeout=600)


with tempfile.TemporaryDirectory() as tmp:
    p = run(tmp, "run", chat)
    expect(f"grpo_train: exit {p.returncode}", p.returncode == 0, p.stdout + p.stderr)
    expect("the memory plan counts the reward model", "reward model" in p.stderr, p.stderr)
    rows = []
    if p.returncode == 0:
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    expect("two steps", len(rows) == 2)
    for r in rows:
        keys = ("reward_terms/boxed_tool_shaping", "reward_terms/model", "time_reward_s", "reward_mean")
        if not all(k in r for k in keys):
            expect(f"step {r.get('step')}: {keys} logged", False, json.dumps(r))
            continue
        rule, model = r["reward_terms/boxed_tool_shaping"], r["reward_terms/model"]
        expect(f"step {r['step']}: reward_mean = rule + 0.5 model", abs(r["reward_mean"] - (rule + 0.5 * model)) < 1e-6,
               json.dumps(r))
        if abs((0.5 * rule + model) - (rule + 0.5 * model)) > 1e-6:
            expect(f"step {r['step']}: the twin differs", abs(r["reward_mean"] - (0.5 * rule + model)) > 1e-6)
        expect(f"step {r['step']}: time_reward_s > 0", r["time_reward_s"] > 0)
    # A folder without its tokenizer and template: refused before training.
    bare = os.path.join(tmp, "bare")
    os.makedirs(bare)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(chat, f), bare)
    p = run(tmp, "bare_run", bare)
    expect(f"no tokenizer: exit {p.returncode}, expected 2", p.returncode == 2, p.stderr)
    expect("no tokenizer: names reward.model_path", "reward.model_path" in p.stderr, p.stderr)
    expect("no tokenizer: nothing trained", not os.path.exists(os.path.join(tmp, "bare_run", "metrics.jsonl")))
    # A causal LM's folder: not a reward model.
    lm = os.path.join(tmp, "lm")
    shutil.copytree(chat, lm)
    with open(os.path.join(lm, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    with open(os.path.join(lm, "config.json"), "w") as f:
        json.dump(cfg, f)
    p = run(tmp, "lm_run", lm)
    expect(f"a causal LM: exit {p.returncode}, expected 2", p.returncode == 2, p.stderr)
    expect("a causal LM: names the architecture", "Qwen3ForCausalLM" in p.stderr, p.stderr)

finish("reward model: ok")
