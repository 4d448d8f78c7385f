"""The command-line contract of grpo_train and ppo_train: --print-config works, and every kind of bad
input (config key, value, model folder, dataset, resume without checkpoint) exits with code 2 and a
message naming what is wrong, before any training starts.

usage: check_train_apps.py GRPO_TRAIN PPO_TRAIN SOURCE_DIR
"""
import os
import subprocess
import sys
import tempfile

grpo, ppo, src = sys.argv[1:4]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
failures = []


def run(binary, args, want_rc, fragments, cwd):
    p = subprocess.run([binary] + args, cwd=cwd, capture_output=True, text=True, timeout=300)
    text = p.stdout + p.stderr
    name = os.path.basename(binary) + " " + " ".join(args)
    if p.returncode != want_rc:
        failures.append(f"{name}: exit {p.returncode}, want {want_rc}\n{text[-2000:]}")
        return
    for f in fragments:
        if f not in text:
            failures.append(f"{name}: '{f}' not in output:\n{text[-2000:]}")


with tempfile.TemporaryDirectory() as tmp:
    out = ["--out", os.path.join(tmp, "run")]
    run(grpo, ["--config", tiny, "--print-config"], 0, ["loss:", "impl: selective", "samples_per_prompt: 8"], tmp)
    run(ppo, ["--config", tiny, "--print-config"], 0, ["ppo:", "lam:"], tmp)
    run(grpo, ["--config", tiny, "--set", "train.stepz=3"] + out, 2, ["train.stepz"], tmp)
    run(grpo, ["--config", tiny, "--set", "train.lr=-1"] + out, 2, ["train.lr"], tmp)
    run(grpo, ["--config", os.path.join(tmp, "missing.yaml")] + out, 2, ["missing.yaml"], tmp)
    run(grpo, ["--config", tiny, "--set", "model.path=" + os.path.join(tmp, "nope")] + out, 2,
        ["model.path", "nope"], tmp)
    run(grpo, ["--config", tiny, "--set", "train.prompts=jsonl", "--set",
               "data.path=" + os.path.join(tmp, "absent.jsonl")] + out, 2, ["absent.jsonl"], tmp)
    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"prompt": "What is 2 * 3?", "answer": "6"}\n{"prompt": "no answer"\n')
    run(ppo, ["--config", tiny, "--set", "train.prompts=jsonl", "--set", "data.path=" + bad] + out, 2,
        ["bad.jsonl:2"], tmp)
    run(grpo, ["--config", tiny, "--resume", "--out", os.path.join(tmp, "never_ran")], 2, ["no checkpoint"], tmp)
    run(grpo, ["--config", tiny, "--stop-after", "-1"] + out, 2, ["--stop-after"], tmp)
    run(grpo, ["--config", tiny, "--set", "model.tokenizer=" + os.path.join(tmp, "none.model")] + out, 2,
        ["none.model"], tmp)

if failures:
    print("\n\n".join(failures))
    sys.exit(1)
print("train apps: all checks passed")
