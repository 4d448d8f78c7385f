"""grpo_train with train.dynamic_sampling (DAPO) on the CPU, from one warmed-up checkpoint:

1. Every step's metrics hold to their definitions: prompts_sampled = sampling_rounds x prompts_per_step =
   groups_filtered + groups_kept + groups_surplus; the rounds stop once prompts_per_step groups are kept
   (then groups_kept = prompts_per_step) or at train.max_sampling_rounds (then fewer may be kept, with no
   surplus); update_skipped = 1 exactly when no group was kept; no metric is NaN. A run with fewer groups
   kept than prompts_per_step warns once, however many steps fall short.
2. A reward that never varies (reward.kind boxed: every answer of the tiny model is wrong) keeps no group:
   every update is skipped, the gradient norm is 0, and the run ends cleanly.
3. --nproc 2 samples and keeps what one process does at step 1 (the same weights): every metric of the
   rollout and of the sampling alike.
4. A run stopped after step 1 and resumed continues as the uninterrupted run went on: the prompt stream
   position and every later step's figures alike.
5. ppo_train refuses train.dynamic_sampling, and grpo_train one sample per prompt, with exit code 2 naming
   the key.
The check of 1 must reject rows that break a definition (prompts_sampled off by one round, a short step
that stopped before the bound).

usage: check_dynamic_sampling.py GRPO_TRAIN PPO_TRAIN SOURCE_DIR
"""
import json
import math
import os
import subprocess
import sys
import tempfile

grpo, ppo, src = sys.argv[1:4]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
failures = []
P = 6
WARM = ["--set", "model.init_hidden=64", "--set", "model.init_layers=2", "--set", "model.init_heads=2",
        "--set", "model.init_kv_heads=1", "--set", "model.init_intermediate=128", "--set", "model.tokenizer_vocab=320",
        "--set", "sft.steps=200", "--set", "sft.tool_fraction=1.0", "--set", "train.steps=1",
        "--set", "train.eval_prompts=0"]
SMALL = ["--set", "sft.steps=0", "--set", f"train.prompts_per_step={P}", "--set", "sampling.samples_per_prompt=4",
         "--set", "sampling.max_new_tokens=48", "--set", "train.eval_prompts=0", "--set", "train.steps=3",
         "--set", "train.lr=1e-3", "--set", "train.micro_batch_size=4", "--set", "train.dynamic_sampling=true"]
DS_KEYS = ["groups_filtered", "groups_kept", "groups_surplus", "sampling_rounds", "prompts_sampled",
           "sampled_accuracy", "update_skipped"]
WARNING = "dynamic sampling kept"


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train(binary, out, *args, expect=0, base=None):
    cmd = [binary, "--config", tiny, *(base if base is not None else SMALL), "--out", out, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != expect:
        print(" ".join(cmd), "\n", p.stderr[-3000:])
    check(p.returncode == expect, f"{' '.join(args)}: exit {p.returncode}, expected {expect}")
    return p


def definition_problems(rs, max_rounds, what):
    """How rows break the metrics' definitions; [] when they hold."""
    out = []
    for r in rs:
        s = f"{what}: step {r.get('step')}"
        missing = [k for k in DS_KEYS if k not in r]
        if missing:
            out.append(f"{s}: no {missing}")
            continue
        bad = [k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            out.append(f"{s}: not finite: {bad}")
        rounds, kept = r["sampling_rounds"], r["groups_kept"]
        if r["prompts_sampled"] != rounds * P:
            out.append(f"{s}: prompts_sampled {r['prompts_sampled']} != {rounds} rounds x {P}")
        if r["groups_filtered"] + kept + r["groups_surplus"] != r["prompts_sampled"]:
            out.append(f"{s}: filtered + kept + surplus != prompts_sampled")
        if not 1 <= rounds <= max_rounds:
            out.append(f"{s}: {rounds} rounds outside 1..{max_rounds}")
        if kept < P and (rounds != max_rounds or r["groups_surplus"] != 0):
            out.append(f"{s}: {kept} of {P} kept before the round bound, or with a surplus")
        # The rounds before the last kept fewer than P, the last at most P: a surplus of P or more means a
        # round was sampled after the step had its groups.
        if kept > P or r["groups_surplus"] >= P:
            out.append(f"{s}: {kept} kept, {r['groups_surplus']} surplus: a round more than the step needed")
        if r["update_skipped"] != (1 if kept == 0 else 0):
            out.append(f"{s}: update_skipped {r['update_skipped']} with {kept} groups kept")
        if kept == 0 and r["grad_norm"] != 0:
            out.append(f"{s}: no group kept, yet a gradient norm of {r['grad_norm']}")
    return out


def warned_once(p, rs, what):
    short = any(r["groups_kept"] < P for r in rs)
    n = p.stderr.count(WARNING)
    check(n == (1 if short else 0), f"{what}: {n} warnings for {'a' if short else 'no'} short step")


with tempfile.TemporaryDirectory() as tmp:
    d = lambda name: os.path.join(tmp, name)
    train(grpo, d("warm"), base=WARM)
    SMALL += ["--set", "model.path=" + os.path.join(d("warm"), "checkpoint", "model")]

    # 1. Two rounds at most (full steps, most of them), then one round (short steps, masked slots).
    p = train(grpo, d("two"), "--set", "train.max_sampling_rounds=2")
    two = rows(d("two"))
    for problem in definition_problems(two, 2, "two rounds"):
        check(False, problem)
    warned_once(p, two, "two rounds")
    check(any(r["groups_kept"] == P for r in two), "two rounds: no step kept all its groups (the warm-up is off)")
    p = train(grpo, d("one"), "--set", "train.max_sampling_rounds=1")
    one = rows(d("one"))
    for problem in definition_problems(one, 1, "one round"):
        check(False, problem)
    warned_once(p, one, "one round")
    check(any(0 < r["groups_kept"] < P for r in one), "one round: no step kept some but not all groups")

    # The twins: rows that break a definition must be caught.
    wrong = [dict(two[0], prompts_sampled=two[0]["prompts_sampled"] + P)]
    check(definition_problems(wrong, 2, "twin"), "prompts_sampled off by a round passed the check")
    wrong = [dict(one[0], groups_kept=P - 1, groups_filtered=one[0]["groups_filtered"] + 1, groups_surplus=0,
                  sampling_rounds=1, prompts_sampled=P, update_skipped=0)]
    check(definition_problems(wrong, 2, "twin"), "a short step before the round bound passed the check")

    # 2. No reward variance: no group kept, no update, a clean end.
    p = train(grpo, d("flat"), "--set", "train.max_sampling_rounds=2", "--set", "reward.kind=boxed",
              "--set", "train.steps=2")
    flat = rows(d("flat"))
    for problem in definition_problems(flat, 2, "flat rewards"):
        check(False, problem)
    check(len(flat) == 2 and all(r["groups_kept"] == 0 and r["update_skipped"] == 1 for r in flat),
          f"flat rewards: groups kept {[r['groups_kept'] for r in flat]}")
    warned_once(p, flat, "flat rewards")

    # 3. Two ranks: step 1 samples and keeps what one process does.
    train(grpo, d("ranks"), "--nproc", "2", "--set", "train.max_sampling_rounds=2")
    ranks = rows(d("ranks"))
    for problem in definition_problems(ranks, 2, "two ranks"):
        check(False, problem)
    for k in DS_KEYS + ["reward_mean", "accuracy", "sampled_tokens", "tokens"]:
        check(ranks and ranks[0].get(k) == two[0].get(k),
              f"two ranks: step 1 {k} {ranks[0].get(k) if ranks else None} != one process's {two[0].get(k)}")

    # 4. Stopped after step 1, resumed: the uninterrupted run's steps 2 and 3.
    train(grpo, d("resumed"), "--set", "train.max_sampling_rounds=2", "--stop-after", "1")
    train(grpo, d("resumed"), "--set", "train.max_sampling_rounds=2", "--resume")
    resumed = rows(d("resumed"))
    check(len(resumed) == len(two), f"resumed: {len(resumed)} steps against {len(two)}")
    for x, y in zip(resumed, two):
        for k in DS_KEYS + ["reward_mean", "sampled_tokens", "loss", "grad_norm"]:
            check(x.get(k) == y.get(k), f"resumed: step {x['step']} {k} {x.get(k)} != {y.get(k)}")

    # 5. Refused where it means nothing.
    p = train(ppo, d("ppo"), expect=2)
    check("train.dynamic_sampling" in p.stderr, "ppo_train: the error does not name train.dynamic_sampling")
    p = train(grpo, d("single"), "--set", "sampling.samples_per_prompt=1", expect=2)
    check("train.dynamic_sampling" in p.stderr, "one sample per prompt: the error does not name the key")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("dynamic sampling: all checks passed")
