"""grpo_train's TensorBoard event files (logging.tensorboard, on by default) read by TensorBoard's own
accumulator: every field of every metrics.jsonl line is a scalar at that line's step, equal to it in
float32 (null, a value that is not finite, is NaN or inf there), and each step has logging.tensorboard_samples
text summaries whose response is the one samples.jsonl logged for that step. A resumed run adds a file
and its steps; a fresh run in the same folder starts the events over; logging.tensorboard=false writes
none. A scalar off by one step, or one value off in float32, fails the comparison. Without the
tensorboard package (a GPU host: scripts/setup.sh installs it elsewhere) it exits 77, which ctest counts
as skipped.

usage: check_tensorboard.py GRPO_TRAIN SOURCE_DIR
"""
import glob
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

from checks import expect, finish

try:
    import tensorboard  # noqa: F401
except ImportError:
    print("tensorboard is not installed (scripts/setup.sh installs it): skipped")
    sys.exit(77)  # ctest's SKIP_RETURN_CODE
grpo, src = sys.argv[1:3]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
reference = os.path.join(src, "tests", "common", "tensorboard_reference.py")
short = ["--set", "sft.steps=0", "--set", "train.prompts_per_step=2", "--set", "sampling.samples_per_prompt=4",
         "--set", "train.eval_prompts=0", "--set", "train.checkpoint_every=1", "--set", "train.log_samples=4"]
def run(args, cwd):
    p = subprocess.run([grpo] + args, cwd=cwd, capture_output=True, text=True, timeout=600)
    expect(f"{' '.join(args)}: exit {p.returncode}", p.returncode == 0, p.stdout + p.stderr)


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def accumulate(folder, tmp):
    out = os.path.join(tmp, "acc.json")
    p = subprocess.run([sys.executable, reference, "accumulate", folder, out], capture_output=True, text=True)
    expect(f"accumulate {folder}: exit {p.returncode}", p.returncode == 0, p.stderr)
    with open(out) as f:
        return json.load(f)


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def same(a, b):  # b from metrics.jsonl (None: not finite), a TensorBoard's float32
    if b is None:
        return math.isnan(a) or math.isinf(a)
    return a == f32(b)


def compare(acc, rows, what):
    """Every metrics.jsonl field at its step, and nothing else."""
    want = {}
    for r in rows:
        for k, v in r.items():
            want.setdefault(k, []).append([int(r["step"]), v])
    expect(f"{what}: tags {sorted(set(want) ^ set(acc['scalars']))} differ", set(want) == set(acc["scalars"]))
    for tag, series in want.items():
        got = acc["scalars"].get(tag, [])
        ok = len(got) == len(series) and all(
            g[0] == s[0] and same(g[1], s[1]) for g, s in zip(got, series))
        expect(f"{what}: {tag} {got} != {series}", ok)
    return want


with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "run")
    run(["--config", tiny, "--out", out, "--set", "train.steps=3", "--stop-after", "2"] + short, tmp)
    run(["--config", tiny, "--out", out, "--set", "train.steps=3", "--resume"] + short, tmp)
    rows = lines(os.path.join(out, "metrics.jsonl"))
    expect(f"{len(rows)} metrics lines, want 3", len(rows) == 3)
    files = glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    expect(f"{len(files)} event files after a resume, want 2", len(files) == 2)
    acc = accumulate(os.path.join(out, "tensorboard"), tmp)
    want = compare(acc, rows, "resumed run")
    # Wrong variants the comparison must reject: a series shifted one step, a value moved by one float32 ulp.
    if want.get("reward_mean"):
        shifted = [[s + 1, v] for s, v in acc["scalars"]["reward_mean"]]
        expect("a shifted series must be rejected",
               not all(g[0] == s[0] for g, s in zip(shifted, want["reward_mean"])))
    loss = acc["scalars"].get("loss", [[0, 1.0]])[0][1]
    bumped = struct.unpack("f", struct.pack("I", struct.unpack("I", struct.pack("f", loss))[0] + 1))[0]
    expect("a value one ulp off must be rejected", not same(bumped, rows[0]["loss"]))
    # Text: 2 samples a step (the default), each the trajectory samples.jsonl logged first for that step.
    samples = lines(os.path.join(out, "samples.jsonl"))
    for i in range(2):
        got = acc["text"].get(f"samples/{i}", [])
        expect(f"samples/{i}: steps {[s for s, _ in got]}, want [1, 2, 3]", [s for s, _ in got] == [1, 2, 3])
        for step, text in got:
            logged = [s for s in samples if s["step"] == step]
            expect(f"samples/{i} at step {step}: the response of samples.jsonl's trajectory {i}",
                   len(logged) > i and logged[i]["response"] in text and logged[i]["prompt"] in text, text)
    # A fresh run in the same folder starts the events over; tensorboard off writes none.
    run(["--config", tiny, "--out", out, "--set", "train.steps=1"] + short, tmp)
    files = glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*"))
    expect(f"{len(files)} event files after a fresh run, want 1", len(files) == 1)
    compare(accumulate(os.path.join(out, "tensorboard"), tmp), lines(os.path.join(out, "metrics.jsonl")), "fresh run")
    off = os.path.join(tmp, "off")
    run(["--config", tiny, "--out", off, "--set", "train.steps=1", "--set", "logging.tensorboard=false"] + short, tmp)
    expect("logging.tensorboard=false: no folder", not os.path.exists(os.path.join(off, "tensorboard")))

finish("tensorboard: every metric at its step, the samples as text, resume and fresh runs")
