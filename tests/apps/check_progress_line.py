"""The console's progress line of grpo_train and ppo_train: one line per RL step whose every figure is the
metrics.jsonl value its label names, at the printed precision (the update's MFU where a peak is known),
and whose loss shows only where its value says something: PPO, and an off-policy GRPO update
(train.num_iterations > 1); never on-policy GRPO, whose loss is -mean(advantage) at ratio 1. The warm-up's live line ends with a newline. Wrong lines (two
figures swapped, a loss on an on-policy line, a field missing) must be rejected by the same check.

usage: check_progress_line.py GRPO_TRAIN PPO_TRAIN SOURCE_DIR
"""
import json
import os
import re
import subprocess
import sys
import tempfile

grpo, ppo, src = sys.argv[1:4]
failures = []

LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<steps>\d+)  reward (?P<reward>\S+)  acc (?P<acc>\S+)%  tool (?P<tool>\S+)%"
    r"  len (?P<len>\S+)(?:  entropy (?P<entropy>\S+))?  grad norm (?P<grad>\S+)  clip (?P<clip>\S+)%"
    r"(?:  loss (?P<loss>\S+))?(?:  kl (?P<kl>\S+))?(?:  mfu (?P<mfu>\S+)%)?  sampled (?P<tps>\S+) tok/s"
    r"  (?P<time>\S+) s/step$")

# label -> (metrics.jsonl key, scale, tolerance: half the printed precision's last digit, or relative).
FIELDS = {
    "reward": ("reward_mean", 1, 5e-4),
    "acc": ("accuracy", 100, 0.5),
    "tool": ("tool_use", 100, 0.5),
    "len": ("response_length_mean", 1, 0.05),
    "entropy": ("entropy", 1, 5e-4),
    "grad": ("grad_norm", 1, "3 significant digits"),
    "clip": ("clip_frac", 100, 0.05),
    "loss": ("loss", 1, "3 significant digits"),
    "mfu": ("update_mfu", 100, 0.05),
    "tps": ("rollout_tokens_per_s", 1, 0.5),
    "time": ("time_step_s", 1, 5e-3),
}


def check(name, text, rows, want_loss):
    """The problems of one run's console text against its metrics.jsonl rows; [] when it is right."""
    problems = []
    lines = [l for l in text.splitlines() if l.startswith("step ")]
    if len(lines) != len(rows):
        problems.append(f"{name}: {len(lines)} progress lines for {len(rows)} steps")
    for line, row in zip(lines, rows):
        m = LINE.match(line)
        if not m:
            problems.append(f"{name}: not a progress line: {line!r}")
            continue
        if int(m["step"]) != row["step"] or int(m["steps"]) != row["steps"]:
            problems.append(f"{name}: {line!r}: step {m['step']}/{m['steps']}, metrics say {row['step']}/{row['steps']}")
        if (m["loss"] is not None) != want_loss:
            problems.append(f"{name}: {line!r}: the loss is {'missing' if want_loss else 'shown'}")
        if (m["mfu"] is not None) != ("update_mfu" in row):
            problems.append(f"{name}: {line!r}: the update's MFU is {'shown' if m['mfu'] else 'missing'}")
        if m["entropy"] is None:
            problems.append(f"{name}: {line!r}: no entropy (loss.entropy is value)")
        for label, (key, scale, tol) in FIELDS.items():
            if m[label] is None:
                continue
            shown, value = float(m[label]), scale * row[key]
            ok = (abs(shown - value) <= max(5e-3 * abs(value), 1e-12) if isinstance(tol, str)
                  else abs(shown - value) <= tol + 1e-9)
            if not ok:
                problems.append(f"{name}: {line!r}: {label} {m[label]} is not {key} {row[key]}")
    return problems


def run(name, binary, config, extra, want_loss, tmp):
    out = os.path.join(tmp, name)
    args = [binary, "--config", os.path.join(src, "configs", config), "--out", out,
            "--set", "train.steps=2", "--set", "sft.steps=3", "--set", "train.prompts_per_step=2",
            "--set", "sampling.samples_per_prompt=4", "--set", "sampling.max_new_tokens=16",
            "--set", "train.eval_prompts=0", "--set", "train.checkpoint_every=0", "--set", "sandbox.workers=2"] + extra
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        failures.append(f"{name}: exit {p.returncode}\n{p.stderr[-2000:]}")
        return None
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    failures.extend(check(name, p.stderr, rows, want_loss))
    # The warm-up's live line ends with a newline: whatever follows it starts a line of its own.
    warm = [l for l in p.stderr.split("\n") if "warm-up 3/3" in l]
    if not warm or not warm[-1].endswith(", done"):
        failures.append(f"{name}: the warm-up's last update does not end its line: {warm!r}")
    return p.stderr, rows


with tempfile.TemporaryDirectory() as tmp:
    on_policy = run("grpo_on_policy", grpo, "retool_tiny.yaml", [], False, tmp)
    # With a peak (the CPU has none in the table), the line shows the update's MFU.
    run("grpo_two_iterations", grpo, "retool_tiny.yaml",
        ["--set", "train.num_iterations=2", "--set", "train.peak_tflops=0.05"], True, tmp)
    run("ppo", ppo, "ppo_tiny.yaml", [], True, tmp)

# Controls: the check must reject a wrong line.
if on_policy:
    text, rows = on_policy
    first = next(l for l in text.splitlines() if l.startswith("step "))
    m = LINE.match(first)
    wrong = {
        "acc and tool swapped": first.replace(f"acc {m['acc']}%  tool {m['tool']}%",
                                              f"acc {m['tool']}%  tool {m['acc']}%"),
        "reward off by 0.01": first.replace(f"reward {m['reward']}", f"reward {float(m['reward']) + 0.01:.3f}"),
        "loss on an on-policy line": first.replace("  sampled ", "  loss -2.794e-09  sampled "),
        "no grad norm": first.replace(f"  grad norm {m['grad']}", ""),
    }
    if m["acc"] == m["tool"]:  # swapping equal figures changes nothing: shift one instead
        wrong["acc and tool swapped"] = first.replace(f"acc {m['acc']}%", f"acc {float(m['acc']) + 1:.0f}%")
    for what, line in wrong.items():
        if not check("control", text.replace(first, line), rows, False):
            failures.append(f"control '{what}' passed the check: {line!r}")

if failures:
    print("\n\n".join(failures))
    sys.exit(1)
print("progress line: all checks passed")
