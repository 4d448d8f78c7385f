"""A real checkpoint end to end, on the CPU: transformers saves a random Qwen3-architecture model (vocabulary
sized as Qwen3's) beside the published Qwen3 tokenizer.json, tokenizer_config.json (with its chat template)
and a generation_config.json; grpo_train runs 2 GRPO steps of configs/retool.yaml, from the source folder with
only model.path and the CPU's sizes set, on the DAPO-Math sample and AIME 2024 that ship in data/ (chat-message
prompts, "label" answers), with the model's own tokenizer, chat template and stop ids
and the <tool_call> format (the template lists the code_interpreter tool);
the checkpoint it writes is a complete HF folder that transformers' AutoModelForCausalLM and AutoTokenizer
load and generate from. The prompt ids grpo_train sampled from are transformers' own apply_chat_template ids.

usage: check_real_checkpoint.py GRPO_TRAIN SOURCE_DIR FIXTURES_DIR
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers

grpo, src, fixtures = sys.argv[1:4]
qwen3 = os.path.join(fixtures, "tokenizers", "qwen3")
dapo = os.path.join(src, "data", "dapo-math-17k-200.jsonl")
failures = []
# The tool the trainer offers in tool_call format (rollout/tools.cpp, ToolProtocol::tool_schema).
CODE_INTERPRETER = {"type": "function", "function": {
    "name": "code_interpreter",
    "description": "Runs Python code in a sandbox and returns what it prints (or the error).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                   "required": ["code"]}}}


def check(ok, what):
    if not ok:
        failures.append(what)


with tempfile.TemporaryDirectory() as tmp:
    ckpt = os.path.join(tmp, "qwen3-tiny")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=4096, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = [151645, 151643]  # Qwen instruct: <|im_end|>, <|endoftext|>
    model.generation_config.pad_token_id = 151643
    model.save_pretrained(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(qwen3, name), ckpt)

    out = os.path.join(tmp, "run")
    cmd = [grpo, "--config", os.path.join(src, "configs", "retool.yaml"), "--out", out,
           "--set", "model.path=" + ckpt, "--set", "model.device=cpu", "--set", "model.dtype=float32",
           "--set", "model.activation_checkpointing=false",
           "--set", "data.max_examples=8",
           "--set", "train.eval_prompts=2", "--set", "train.eval_samples=2",
           "--set", "train.eval_every=2",
           "--set", "train.steps=2", "--set", "train.prompts_per_step=2", "--set", "train.micro_batch_size=4",
           "--set", "train.checkpoint_every=0", "--set", "train.log_samples=4",
           "--set", "sampling.samples_per_prompt=2", "--set", "sampling.max_new_tokens=24",
           "--set", "rollout.max_context=1024", "--set", "rollout.max_turns=2",
           "--set", "sandbox.workers=2", "--set", "loss.impl=selective"]
    # From the source folder, as a user runs it: the config's data.path and data.eval_path are the shipped
    # data/dapo-math-17k-200.jsonl and data/aime-2024.jsonl.
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=src)
    text = p.stdout + p.stderr
    check(p.returncode == 0, f"grpo_train exit {p.returncode}:\n{text[-3000:]}")
    if p.returncode == 0:
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        check(len(rows) == 2, f"{len(rows)} metrics rows, want 2")
        # AIME 2024 evaluated after step 2 (the last): pass@1 from 2 samples of 2 problems.
        last = rows[-1] if rows else {}
        check("eval_pass@1" in last and last["eval_pass@1"] * 4 == int(last["eval_pass@1"] * 4),
              f"no AIME evaluation in the last metrics row: {sorted(last)}")
        samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
        check(len(samples) >= 2, f"{len(samples)} samples logged")
        # The model's own template framed the prompt: decoded, it is transformers' apply_chat_template text
        # for the row's messages with the config's system turn.
        tok0 = transformers.AutoTokenizer.from_pretrained(ckpt)
        rows_by_text = {}
        for line in open(dapo):
            row = json.loads(line)
            rows_by_text[row["prompt"][-1]["content"]] = row
        for s in samples:
            user = s["prompt"].split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
            row = rows_by_text.get(user)
            check(row is not None, f"sampled prompt is no DAPO row: {s['prompt'][:200]!r}")
            if row is None:
                continue
            # The system turn as written: the config's text, before the template's own tools block.
            system = s["prompt"].split("<|im_start|>system\n", 1)[-1].split("<|im_end|>", 1)[0]
            system = system.split("\n\n# Tools\n", 1)[0]
            want = tok0.apply_chat_template([{"role": "system", "content": system}] + row["prompt"],
                                            tools=[CODE_INTERPRETER], add_generation_prompt=True, tokenize=False)
            check(s["prompt"] == want, f"prompt differs from apply_chat_template:\n{s['prompt']!r}\n{want!r}")

        saved = os.path.join(out, "checkpoint", "model")
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            check(os.path.exists(os.path.join(saved, name)), f"checkpoint lacks {name}")
        tok = transformers.AutoTokenizer.from_pretrained(saved)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved)
        check(reloaded.generation_config.eos_token_id == [151645, 151643], "generation_config lost its stop ids")
        ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        gen = reloaded.generate(ids, max_new_tokens=4, do_sample=False)
        check(gen.shape[1] > ids.shape[1], "transformers generated nothing from the saved checkpoint")
        # The update moved the weights (2 steps), so the saved model is not the one we started from.
        start = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
        moved = any(not torch.equal(a, b) for a, b in zip(start.state_dict().values(), reloaded.state_dict().values()))
        check(moved or all(r["grad_norm"] == 0 for r in rows), "the saved weights equal the starting ones")

if failures:
    print("\n\n".join(failures))
    sys.exit(1)
print("real checkpoint: grpo_train trained it and transformers reloads it")
