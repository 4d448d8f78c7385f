"""grpo_train with reward.kind python on configs/retool_tiny.yaml (no warm-up, 2 steps of 4 x 4 trajectories):
a script that prints to stdout and returns a dict trains, logging reward_errors 0 and its field; a script
that raises on every trajectory trains too, every trajectory gets reward.wrong and is counted, and the
traceback is shown once; reward.script is read relative to the config file that sets it; a script without
reward() and a missing one exit with code 2 naming the path.

usage: check_python_reward.py GRPO_TRAIN SOURCE_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

from checks import expect, failures, finish

grpo, src = sys.argv[1:3]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
short = ["--set", "sft.steps=0", "--set", "train.steps=2", "--set", "train.prompts_per_step=4",
         "--set", "sampling.samples_per_prompt=4", "--set", "train.eval_prompts=0"]
S = 16  # trajectories a step
def run(args, want_rc, cwd):
    p = subprocess.run([grpo] + args, cwd=cwd, capture_output=True, text=True, timeout=300)
    if p.returncode != want_rc:
        failures.append(f"{' '.join(args)}: exit {p.returncode}, want {want_rc}\n{(p.stdout + p.stderr)[-3000:]}")
    return p.stdout + p.stderr


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


with tempfile.TemporaryDirectory() as tmp:
    good = os.path.join(tmp, "good.py")
    with open(good, "w") as f:
        f.write("import os\n"
                "print('{\"i\": 0, \"score\": 99}')\n"
                "def reward(prompt, response, answer):\n"
                "    print('{\"i\": 0, \"score\": 99}')\n"
                "    os.write(1, b'{\"i\": 1, \"score\": 99}\\n')\n"
                "    return {'score': 1.0 if answer in response else 0.0, 'one': 1.0}\n")
    out = os.path.join(tmp, "good_run")
    text = run(["--config", tiny, "--set", "reward.kind=python", "--set", "reward.script=" + good, "--out", out]
               + short, 0, tmp)
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        rows = metrics(out)
        expect("good script: 2 steps", len(rows) == 2, text)
        for r in rows:
            expect(f"good script: reward_errors {r.get('reward_errors')}, want 0", r.get("reward_errors") == 0)
            expect(f"good script: reward/one {r.get('reward/one')}, want 1", r.get("reward/one") == 1.0)
            # Scores are 0 or 1 (a printed 99 never got through): the mean is the accuracy.
            expect("good script: reward_mean is the accuracy", r["reward_mean"] == r["accuracy"])

    raising = os.path.join(tmp, "raising.py")
    with open(raising, "w") as f:
        f.write("def reward(prompt, response, answer):\n"
                "    raise ValueError('no verdict for ' + answer)\n")
    out = os.path.join(tmp, "raising_run")
    text = run(["--config", tiny, "--set", "reward.kind=python", "--set", "reward.script=" + raising,
                "--set", "reward.wrong=-0.5", "--out", out] + short, 0, tmp)
    if os.path.exists(os.path.join(out, "metrics.jsonl")):
        rows = metrics(out)
        expect("raising script: 2 steps", len(rows) == 2, text)
        for r in rows:
            expect(f"raising script: reward_errors {r.get('reward_errors')}, want {S}", r.get("reward_errors") == S)
            expect(f"raising script: reward_mean {r['reward_mean']}, want -0.5", r["reward_mean"] == -0.5)
            expect("raising script: accuracy 0", r["accuracy"] == 0)
    expect("raising script: the failure shown once", text.count("warning: reward.script") == 1, text)
    expect("raising script: its traceback", "ValueError: no verdict for" in text and raising in text, text)

    # A config file in another folder naming the script by a relative path.
    sub = os.path.join(tmp, "configs")
    os.makedirs(os.path.join(sub, "rewards"))
    with open(os.path.join(sub, "rewards", "r.py"), "w") as f:
        f.write("def reward(prompt, response, answer):\n    return 0.0\n")
    with open(os.path.join(sub, "python.yaml"), "w") as f:
        f.write(f"defaults: {tiny}\nreward:\n  kind: python\n  script: rewards/r.py\n")
    text = run(["--config", os.path.join(sub, "python.yaml"), "--print-config"], 0, tmp)
    expect("relative reward.script", f'script: "{os.path.join(sub, "rewards", "r.py")}"' in text, text)

    none = os.path.join(tmp, "none.py")
    with open(none, "w") as f:
        f.write("def score(prompt, response, answer):\n    return 1.0\n")
    text = run(["--config", tiny, "--set", "reward.kind=python", "--set", "reward.script=" + none], 2, tmp)
    expect("no reward(): named", none + " defines no function reward" in text, text)
    missing = os.path.join(tmp, "missing.py")
    text = run(["--config", tiny, "--set", "reward.kind=python", "--set", "reward.script=" + missing], 2, tmp)
    expect("missing script: named", missing + ": cannot read" in text, text)
    text = run(["--config", tiny, "--set", "reward.kind=python"], 2, tmp)
    expect("no script: named", "reward.script" in text, text)

finish("python reward in grpo_train: all checks passed")
