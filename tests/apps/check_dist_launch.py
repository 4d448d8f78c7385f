"""grpo_train's data-parallel launch on the CPU (the store's collectives over a TCPStore, real processes):

1. --nproc 2 trains: rank 0 alone writes metrics.jsonl (one row per step, world_size 2), and every step
   samples what one process samples (the same rewards and token counts: prompts keep their noise streams);
   torchrun --nproc-per-node 2 (whose agent serves the rendezvous store) trains the same run; a 2-rank run
   stopped (--stop-after) and resumed on 2 ranks repeats the uninterrupted one; ppo_train --nproc 2 trains;
   with train.rollout_ranks 1 (rank 1 samples, rank 0 trains), in turn and one_step, the steps are one
   process's, and a one_step run stopped and resumed repeats the uninterrupted one.
2. A rank killed mid-run ends the job at once with a message naming it; the checkpoint folder holds the
   last complete checkpoint, and --resume continues it on one process, as the uninterrupted run went on.
3. A rank that hangs (SIGSTOP) ends the job within train.dist_timeout_s, the message naming the late rank.
4. Bad launches exit with code 2 and say why: a partial set of torchrun variables, a step that does not
   split over the ranks, rollout ranks in one process or with no training rank left.

usage: check_dist_launch.py GRPO_TRAIN SOURCE_DIR [PPO_TRAIN]
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from checks import LAUNCH_SMALL as SMALL  # the launch checks' shrunken run

grpo, src = sys.argv[1:3]
ppo = sys.argv[3] if len(sys.argv) > 3 else None
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
failures = []


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(cond, what):
    if not cond:
        failures.append(what)


def ranks_of(parent_pid):
    """{rank: pid} of the launcher's children, from their environment."""
    out = {}
    try:
        with open(f"/proc/{parent_pid}/task/{parent_pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except OSError:
        return out
    for pid in kids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = pid
        except (OSError, KeyError, ValueError):
            pass
    return out


def checkpoint_step(run_dir):
    try:
        with open(os.path.join(run_dir, "checkpoint", "state.json")) as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return 0


def run_until_checkpoint_then(args, run_dir, action, deadline_s=240):
    """Starts a --nproc 2 run, waits for its first checkpoint, does action(ranks), returns (rc, stderr, s)."""
    p = subprocess.Popen([grpo] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    acted = None
    while p.poll() is None and time.time() - t0 < deadline_s:
        if checkpoint_step(run_dir) >= 2:
            ranks = ranks_of(p.pid)
            if 1 in ranks:
                action(ranks)
                acted = time.time()
                break
        time.sleep(0.05)
    try:
        _, err = p.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
        failures.append(f"{args}: still running {deadline_s} s after the fault")
    return p.returncode, err, (time.time() - acted) if acted else None


with tempfile.TemporaryDirectory() as tmp:
    # 1. Two ranks against one process: the same samples every step; rank 0 writes each row once.
    one, two = os.path.join(tmp, "one"), os.path.join(tmp, "two")
    base = ["--config", tiny] + SMALL + ["--set", "train.steps=4"]
    r1 = subprocess.run([grpo] + base + ["--out", one], capture_output=True, text=True, timeout=600)
    r2 = subprocess.run([grpo] + base + ["--out", two, "--nproc", "2"], capture_output=True, text=True, timeout=600)
    check(r1.returncode == 0, f"one process: exit {r1.returncode}\n{r1.stderr[-2000:]}")
    check(r2.returncode == 0, f"--nproc 2: exit {r2.returncode}\n{r2.stderr[-2000:]}")
    if r1.returncode == 0 and r2.returncode == 0:
        a, b = rows(one), rows(two)
        check(len(a) == 4 and len(b) == 4, f"rows: {len(a)} and {len(b)}, want 4 each")
        for x, y in zip(a, b):
            check(y["world_size"] == 2 and x["world_size"] == 1, f"world_size {x['world_size']}, {y['world_size']}")
            for k in ("reward_mean", "sampled_tokens", "tokens", "response_length_max", "tool_calls_mean"):
                check(x[k] == y[k], f"step {x['step']}: {k} {x[k]} (one process) != {y[k]} (two ranks)")
        check(r2.stderr.count("step 1/4") == 1, "one progress line per step (rank 0's)")

    # torchrun (its agent serves the store): the same run as --nproc 2.
    tr = os.path.join(tmp, "torchrun")
    r3 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python", grpo] + base +
                        ["--out", tr], capture_output=True, text=True, timeout=600)
    check(r3.returncode == 0, f"torchrun --nproc-per-node 2: exit {r3.returncode}\n{r3.stderr[-2000:]}")
    if r3.returncode == 0 and r2.returncode == 0:
        for x, y in zip(rows(two), rows(tr)):
            for k in ("reward_mean", "sampled_tokens", "loss", "world_size"):
                check(x[k] == y[k], f"torchrun step {x['step']}: {k} {y[k]} != {x[k]} (--nproc 2)")

    # --stop-after 2 on two ranks, then --resume on two ranks: the uninterrupted run's steps 3 and 4.
    part = os.path.join(tmp, "part")
    a = subprocess.run([grpo] + base + ["--out", part, "--nproc", "2", "--stop-after", "2"], capture_output=True,
                       text=True, timeout=600)
    b = subprocess.run([grpo] + base + ["--out", part, "--nproc", "2", "--resume"], capture_output=True, text=True,
                       timeout=600)
    check(a.returncode == 0 and b.returncode == 0, f"stop/resume on 2 ranks: exit {a.returncode}, {b.returncode}\n"
                                                    f"{(a.stderr + b.stderr)[-2000:]}")
    if a.returncode == 0 and b.returncode == 0 and r2.returncode == 0:
        check([r["step"] for r in rows(part)] == [1, 2, 3, 4], f"stop/resume steps: {[r['step'] for r in rows(part)]}")
        for x, y in zip(rows(two), rows(part)):
            for k in ("reward_mean", "sampled_tokens", "loss", "grad_norm"):
                check(x[k] == y[k], f"resumed 2-rank run, step {x['step']}: {k} {y[k]} != {x[k]}")
    # PPO through the same launch: its value head and whitening over two ranks.
    if ppo:
        p2 = subprocess.run([ppo] + base + ["--out", os.path.join(tmp, "ppo2"), "--nproc", "2"], capture_output=True,
                            text=True, timeout=600)
        check(p2.returncode == 0 and len(rows(os.path.join(tmp, "ppo2"))) == 4,
              f"ppo_train --nproc 2: exit {p2.returncode}\n{p2.stderr[-2000:]}")

    # train.rollout_ranks 1 of --nproc 2, in turn and one_step: rank 1 samples, rank 0 trains, and the steps
    # are one process's (the same samples and losses); one_step stopped and resumed goes on alike.
    # one_step is off-policy, and the rollout's log-probs move by rounding with the rows a decode step shares,
    # which depend on when tool replies return: the losses compare bit for bit on recomputed old log-probs.
    for mode in ("off", "one_step"):
        mode_set = ["--set", f"train.async={mode}"] + (["--set", "train.old_logprobs=recompute"]
                                                        if mode == "one_step" else [])
        ref = os.path.join(tmp, f"ref_{mode}")
        placed = os.path.join(tmp, f"placed_{mode}")
        r = subprocess.run([grpo] + base + mode_set + ["--out", ref], capture_output=True, text=True, timeout=600)
        p = subprocess.run([grpo] + base + mode_set + ["--set", "train.rollout_ranks=1", "--out", placed,
                                                       "--nproc", "2"], capture_output=True, text=True, timeout=600)
        check(r.returncode == 0 and p.returncode == 0, f"rollout_ranks, async {mode}: exit {r.returncode}, "
                                                        f"{p.returncode}\n{(r.stderr + p.stderr)[-2000:]}")
        if r.returncode != 0 or p.returncode != 0:
            continue
        check("ranks 1..1 sample" in p.stderr, f"the placement is not announced:\n{p.stderr[-800:]}")
        check(len(rows(placed)) == 4, f"rollout_ranks, async {mode}: {len(rows(placed))} rows")
        for x, y in zip(rows(ref), rows(placed)):
            keys = ("reward_mean", "sampled_tokens", "loss", "grad_norm") + (("staleness_mean",) if mode == "one_step"
                                                                            else ())
            for k in keys:
                check(x.get(k) == y.get(k), f"rollout_ranks, async {mode}, step {x['step']}: {k} {y.get(k)} != "
                                            f"{x.get(k)} (one process)")
            check(y["transfer_mb"] > 0, "no trajectories were received")
        if mode == "one_step":
            part = os.path.join(tmp, "placed_part")
            flags = ["--set", "train.rollout_ranks=1", "--out", part, "--nproc", "2"]
            a = subprocess.run([grpo] + base + mode_set + flags + ["--stop-after", "2"], capture_output=True,
                               text=True, timeout=600)
            b = subprocess.run([grpo] + base + mode_set + flags + ["--resume"], capture_output=True, text=True,
                               timeout=600)
            check(a.returncode == 0 and b.returncode == 0, f"rollout_ranks stop/resume: exit {a.returncode}, "
                                                            f"{b.returncode}\n{(a.stderr + b.stderr)[-2000:]}")
            if a.returncode == 0 and b.returncode == 0:
                check(len(rows(part)) == 4, f"resumed placed run: {len(rows(part))} rows, want 4")
                for x, y in zip(rows(placed), rows(part)):
                    for k in ("reward_mean", "sampled_tokens", "loss", "grad_norm", "staleness_mean"):
                        check(x[k] == y[k], f"resumed placed run, step {x['step']}: {k} {y[k]} != {x[k]}")
            # Killed after a checkpoint whose rollout is pending: the checkpoint records what a colocated
            # one_step run's does (the pending rollout's prompts drawn, its weights one version behind),
            # and the run resumed from it goes on as the uninterrupted one.
            cut = os.path.join(tmp, "placed_killed")
            args = ["--config", tiny] + SMALL + mode_set + ["--set", "train.steps=60", "--set", "train.rollout_ranks=1",
                                                            "--out", cut, "--nproc", "2"]
            rc, err, _ = run_until_checkpoint_then(args, cut, lambda ranks: os.kill(ranks[1], signal.SIGKILL))
            check(rc != 0, f"killed rollout rank: exit {rc}, want non-zero")
            try:
                with open(os.path.join(cut, "checkpoint", "state.json")) as f:
                    state = json.load(f)
            except (OSError, ValueError) as e:
                state = {}
                failures.append(f"killed placed run: no checkpoint state ({e})")
            if state:
                step = state["step"]
                check(state["async"]["version"] == step - 1 and
                      state["async"]["prompts_begin"] == 4 * step and state["prompts_consumed"] == 4 * (step + 1),
                      f"killed placed run's checkpoint at step {step}: {state}")
                check(os.path.exists(os.path.join(cut, "checkpoint", "rollout_weights", "config.json")),
                      "the pending rollout's weights are not in the checkpoint")
                if step + 2 <= 4:
                    r = subprocess.run([grpo, "--config", tiny] + SMALL + mode_set +
                                       ["--set", f"train.steps={step + 2}", "--set", "train.rollout_ranks=1", "--out",
                                        cut, "--nproc", "2", "--resume"], capture_output=True, text=True, timeout=600)
                    check(r.returncode == 0, f"resume after the kill: exit {r.returncode}\n{r.stderr[-2000:]}")
                    got = {x["step"]: x for x in rows(cut)}
                    for x in rows(placed)[step:step + 2]:
                        y = got.get(x["step"], {})
                        for k in ("reward_mean", "sampled_tokens", "loss", "staleness_mean"):
                            check(y.get(k) == x[k], f"resumed after the kill, step {x['step']}: {k} {y.get(k)} != "
                                                    f"{x[k]}")

    # 2. Kill rank 1 after the first checkpoint: the job ends naming it; the checkpoint resumes.
    killed = os.path.join(tmp, "killed")
    long = ["--config", tiny] + SMALL + ["--set", "train.steps=60", "--out", killed, "--nproc", "2"]
    rc, err, after = run_until_checkpoint_then(long, killed, lambda ranks: os.kill(ranks[1], signal.SIGKILL))
    check(rc != 0, f"killed rank: exit {rc}, want non-zero")
    check("rank 1 was killed by signal 9" in err, f"killed rank not named:\n{err[-2000:]}")
    check(after is not None and after < 30, f"the job took {after} s to end after the kill")
    step = checkpoint_step(killed)
    check(step >= 2 and step < 60, f"checkpoint at step {step}")
    # save_checkpoint writes checkpoint.tmp and renames it: checkpoint/ itself is whole.
    check(os.path.exists(os.path.join(killed, "checkpoint", "optimizer-0.safetensors")), "checkpoint/ incomplete")
    # Resume on one process up to step + 2; it samples what the uninterrupted one-process run samples.
    resumed = subprocess.run([grpo, "--config", tiny] + SMALL + ["--set", f"train.steps={step + 2}", "--out", killed,
                              "--resume"], capture_output=True, text=True, timeout=600)
    check(resumed.returncode == 0, f"resume on one process: exit {resumed.returncode}\n{resumed.stderr[-2000:]}")
    ref = os.path.join(tmp, "ref")
    full = subprocess.run([grpo, "--config", tiny] + SMALL + ["--set", f"train.steps={step + 2}", "--out", ref],
                          capture_output=True, text=True, timeout=600)
    if resumed.returncode == 0 and full.returncode == 0:
        got = {r["step"]: r for r in rows(killed)}
        for r in rows(ref)[step:]:
            check(r["step"] in got and got[r["step"]]["reward_mean"] == r["reward_mean"] and
                  got[r["step"]]["sampled_tokens"] == r["sampled_tokens"],
                  f"resumed step {r['step']}: not the uninterrupted run's samples")
            check(got.get(r["step"], {}).get("world_size") == 1, "the resumed steps ran on one process")

    # 3. A hung rank (stopped): the other gives up after train.dist_timeout_s naming it.
    hung = os.path.join(tmp, "hung")
    args = ["--config", tiny] + SMALL + ["--set", "train.steps=60", "--set", "train.dist_timeout_s=3", "--out", hung,
                                         "--nproc", "2"]
    rc, err, after = run_until_checkpoint_then(args, hung, lambda ranks: os.kill(ranks[1], signal.SIGSTOP))
    check(rc == 1, f"hung rank: exit {rc}, want 1")
    check("rank 1 did not reach collective" in err, f"hung rank not named:\n{err[-2000:]}")
    check(after is not None and after < 30, f"the job took {after} s to end after the hang")

    # 4. Bad launches: code 2, the reason named.
    env = dict(os.environ, RANK="0", WORLD_SIZE="2")
    bad = subprocess.run([grpo] + base + ["--out", os.path.join(tmp, "bad")], capture_output=True, text=True,
                         env=env, timeout=120)
    check(bad.returncode == 2 and "LOCAL_RANK is not set" in bad.stderr, f"partial variables: {bad.returncode} {bad.stderr[-500:]}")
    odd = subprocess.run([grpo] + base + ["--set", "train.prompts_per_step=3", "--out", os.path.join(tmp, "odd"),
                                          "--nproc", "2"], capture_output=True, text=True, timeout=300)
    check(odd.returncode == 2 and "train.prompts_per_step = 3" in odd.stderr,
          f"a step that does not split: {odd.returncode} {odd.stderr[-800:]}")
    alone = subprocess.run([grpo] + base + ["--set", "train.rollout_ranks=1", "--out", os.path.join(tmp, "alone")],
                           capture_output=True, text=True, timeout=120)
    check(alone.returncode == 2 and "needs several ranks" in alone.stderr,
          f"rollout ranks without ranks: {alone.returncode} {alone.stderr[-500:]}")
    none = subprocess.run([grpo] + base + ["--set", "train.rollout_ranks=2", "--out", os.path.join(tmp, "none"),
                                           "--nproc", "2"], capture_output=True, text=True, timeout=120)
    check(none.returncode == 2 and "leaves no training rank" in none.stderr,
          f"no training rank: {none.returncode} {none.stderr[-500:]}")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
