"""grpo_train's evaluation over several sets: the held-out prompts, data.eval_path and data.eval_sets, each
logged as eval_avg@k/<set> and eval_pass@j/<set> beside the whole evaluation's figures. A reward script marks
a completion correct by its text's length parity, so the sets' figures differ. Checked: every set's keys are
there at each evaluation, and the whole evaluation's avg@k and pass@j are the sets' problem-weighted means
(4, 2 and 3 problems); the sets' plain mean, the twin, must not match where the sets differ. A set named
twice (two files of one name) is refused with exit code 2.

usage: check_eval_sets.py GRPO_TRAIN SOURCE_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

from checks import expect, finish

grpo, src = sys.argv[1:3]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
with tempfile.TemporaryDirectory() as tmp:
    sizes = {"held_out": 4, "two": 2, "three": 3}
    for name in ("two", "three"):
        os.makedirs(os.path.join(tmp, name), exist_ok=True)
        with open(os.path.join(tmp, name, name + ".jsonl"), "w") as f:
            for i in range(sizes[name]):
                f.write(json.dumps({"prompt": f"What is {12 + i} * {3 + i}?", "answer": str((12 + i) * (3 + i))}) + "\n")
    script = os.path.join(tmp, "parity.py")
    with open(script, "w") as f:
        f.write("def reward(prompt, response, answer):\n    return {'score': 1.0, 'correct': len(response) % 2 == 0}\n")
    args = ["--config", tiny, "--set", "sft.steps=0", "--set", "train.prompts_per_step=2",
            "--set", "sampling.samples_per_prompt=2", "--set", "train.steps=2", "--set", "train.eval_every=1",
            "--set", "train.eval_prompts=4", "--set", "train.eval_samples=2", "--set", "train.checkpoint_every=0",
            "--set", "reward.kind=python", "--set", "reward.script=" + script,
            "--set", "data.eval_sets=[{path: " + os.path.join(tmp, "two", "two.jsonl") + "}, {path: "
            + os.path.join(tmp, "three", "three.jsonl") + "}]", "--out", os.path.join(tmp, "run")]
    p = subprocess.run([grpo] + args, cwd=tmp, capture_output=True, text=True, timeout=600)
    expect(f"grpo_train: exit {p.returncode}", p.returncode == 0, p.stdout + p.stderr)
    rows = []
    if p.returncode == 0:
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    expect("two steps logged", len(rows) == 2, p.stderr)
    differ = False
    for row in rows:
        for key in ("eval_avg@2", "eval_pass@1", "eval_pass@2"):
            parts = {s: row.get(key + "/" + s) for s in sizes}
            expect(f"step {row['step']}: {key} of every set", all(v is not None for v in parts.values()), str(row))
            if any(v is None for v in parts.values()) or key not in row:
                continue
            weighted = sum(sizes[s] * v for s, v in parts.items()) / sum(sizes.values())
            expect(f"step {row['step']}: {key} = the sets' weighted mean", abs(row[key] - weighted) < 1e-12,
                   f"{row[key]} vs {weighted}: {parts}")
            plain = sum(parts.values()) / len(parts)
            differ = differ or abs(plain - weighted) > 1e-9
            if abs(plain - weighted) > 1e-9:
                expect(f"step {row['step']}: the twin (plain mean) differs", abs(row[key] - plain) > 1e-9)
    expect("some evaluation's sets differ (else the twin proves nothing)", differ, json.dumps(rows))
    # Two files named alike: one set name, refused before training.
    os.makedirs(os.path.join(tmp, "again"), exist_ok=True)
    with open(os.path.join(tmp, "again", "two.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "What is 2 * 3?", "answer": "6"}) + "\n")
    bad = [a for a in args]
    bad[bad.index("--out") + 1] = os.path.join(tmp, "bad")
    i = [j for j, a in enumerate(bad) if a.startswith("data.eval_sets=")][0]
    bad[i] = "data.eval_sets=[{path: " + os.path.join(tmp, "two", "two.jsonl") + "}, {path: " + \
        os.path.join(tmp, "again", "two.jsonl") + "}]"
    p = subprocess.run([grpo] + bad, cwd=tmp, capture_output=True, text=True, timeout=600)
    expect(f"a set named twice: exit {p.returncode}, expected 2", p.returncode == 2, p.stderr)
    expect("the message names the set", "a second set named 'two'" in p.stderr, p.stderr)

finish("eval sets: ok")
