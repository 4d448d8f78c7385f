"""grpo_train over several nodes, played on one host (the CPU, the store's collectives, real processes).
Each "node" is a launcher process; they meet at 127.0.0.1 on a free port, as nodes meet at node 0's address.

1. Two launchers `--nproc 1 --nnodes 2 --node-rank 0/1` write the metrics.jsonl of one `--nproc 2` run
   (every figure but times and the rollout's scheduling counters). They run with one srun task per node's
   SLURM_* set, which a launcher ignores. The same comparison rejects a one-process run's rows (the twin:
   nodes that never joined one world train alone).
2. torchrun, when importable: two `torch.distributed.run --nnodes 2 --node-rank R --nproc-per-node 1`
   launchers (static rendezvous) write the same rows; so do two srun-like tasks (SLURM_PROCID 0/1,
   SLURM_NTASKS 2, SLURM_LOCALID 0, MASTER_ADDR, MASTER_PORT) started directly.
3. A rank's GPU is cuda:LOCAL_RANK: with model.device cuda (this host has none), node 1's rank (RANK 1,
   LOCAL_RANK 0) asks for cuda:0, where one node's second rank (--nproc 2) asks for cuda:1.
4. Launches that must fail, each within seconds (train.dist_timeout_s 3 where a wait is involved): two
   launchers both --node-rank 0 (and, in a fixed order, one whose port a store held here serves: it names the
   clash once the store's owner claims node 0, the port where nobody does); launchers that disagree on --nnodes; a node whose peer never comes; bad
   flag combinations (exit 2, the flag named); a partial Slurm set (exit 2, the variable named).
5. A rank killed on node 1 stops node 0's ranks at once (train.dist_timeout_s 600: only the launchers'
   posted failure can end it quickly), both launchers naming the killed rank.

usage: check_multinode.py GRPO_TRAIN SOURCE_DIR
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from checks import LAUNCH_SMALL as SMALL  # the launch checks' shrunken run

grpo, src = sys.argv[1:3]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
failures = []
BASE = ["--config", tiny] + SMALL + ["--set", "train.steps=4"]
# Torchrun's and Slurm's variables of the test's own environment would change what a process is.
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
         ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RLT_MASTER_LISTEN_FD")}


def check(cond, what):
    if not cond:
        failures.append(what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def varies(key):
    """Figures that differ between two runs of the same ranks: times, rates, memory peaks, the rollout's
    scheduling counters (how sandbox replies fell between decode steps), and the rollout's log-probs against
    the training forward's (logprob_mismatch_*): a decode step's rows are whichever were ready when the
    replies landed, and a CPU GEMM's last bits depend on its row count. The tokens sampled, and every
    figure of the update, are the same."""
    phase_peak = key.startswith("memory_allocated_peak_") and key != "memory_allocated_peak_mib"  # each phase's
    kinds = ("time_", "rollout_", "peak_memory", "logprob_mismatch_")
    return phase_peak or key.startswith(kinds) or key.endswith("_per_s")


def differences(a, b):
    """What differs between two runs' metrics.jsonl rows, figures that vary between runs aside."""
    out = []
    if len(a) != len(b):
        out.append(f"{len(a)} rows against {len(b)}")
    for x, y in zip(a, b):
        for k in sorted(set(x) | set(y)):
            if not varies(k) and x.get(k) != y.get(k):
                out.append(f"step {x.get('step')}: {k} {x.get(k)} != {y.get(k)}")
    return out


def run_nodes(argvs, envs=None, timeout=600):
    """Starts one process per argv at once; returns [(returncode, stderr, seconds)] once all have exited."""
    t0 = time.time()
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=(envs[i] if envs else CLEAN)) for i, a in enumerate(argvs)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += f"\n[killed by the test after {timeout} s]"
        out.append((p.returncode, err, time.time() - t0))
    return out


def launchers(extra, port, node_ranks=(0, 1), nnodes=(2, 2)):
    return [[grpo] + extra + ["--nproc", "1", "--nnodes", str(m), "--node-rank", str(r), "--master-addr", "127.0.0.1",
                              "--master-port", str(port)] for r, m in zip(node_ranks, nnodes)]


def ok(results, what):
    for i, (rc, err, _) in enumerate(results):
        check(rc == 0, f"{what}, process {i}: exit {rc}\n{err[-2000:]}")
    return all(rc == 0 for rc, _, _ in results)


with tempfile.TemporaryDirectory() as tmp:
    # 1. The reference: one node, two ranks; and one process, for the twin.
    ref, one = os.path.join(tmp, "ref"), os.path.join(tmp, "one")
    r = run_nodes([[grpo] + BASE + ["--out", ref, "--nproc", "2"], [grpo] + BASE + ["--out", one]])
    ok(r, "--nproc 2 and one process")
    check(len(rows(ref)) == 4, f"--nproc 2: {len(rows(ref))} rows, want 4")
    check(differences(rows(ref), rows(one)) != [],
          "the comparison accepts a one-process run's rows for two ranks' (it must see the world)")

    # Two launchers over one --out (a shared folder, as nodes share one), each an srun task of its node.
    two = os.path.join(tmp, "two")
    port = free_port()
    envs = [dict(CLEAN, SLURM_PROCID=str(n), SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(n))
            for n in (0, 1)]
    r = run_nodes(launchers(BASE + ["--out", two], port), envs)
    if ok(r, "two launchers --nnodes 2"):
        d = differences(rows(ref), rows(two))
        check(d == [], "two nodes' launchers against --nproc 2:\n  " + "\n  ".join(d[:10]))
        check(f"node 1: ranks 1..1 of 2 started (rendezvous 127.0.0.1:{port})" in r[1][1],
              f"node 1's launcher does not say which ranks it started:\n{r[1][1][-1000:]}")
        check("step 4/4" in r[0][1] and "step 4/4" not in r[1][1], "rank 0 (node 0) alone reports progress")

    # 2. torchrun's static rendezvous over two launchers (its agent on node 0 serves the store).
    try:
        import torch.distributed.run  # noqa: F401
        have_torchrun = True
    except ImportError:
        have_torchrun = False
        print("torch.distributed.run is not importable: its two-node launch is not checked")
    if have_torchrun:
        tr = os.path.join(tmp, "torchrun")
        port = free_port()
        r = run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                        "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                        "--no-python", grpo] + BASE + ["--out", tr] for n in (0, 1)])
        if ok(r, "torchrun --nnodes 2"):
            d = differences(rows(ref), rows(tr))
            check(d == [], "torchrun --nnodes 2 against --nproc 2:\n  " + "\n  ".join(d[:10]))

    # Slurm: srun's tasks, one per GPU; task 0 serves the store at MASTER_ADDR:MASTER_PORT.
    sl = os.path.join(tmp, "slurm")
    port = free_port()
    envs = [dict(CLEAN, SLURM_PROCID=str(n), SLURM_NTASKS="2", SLURM_LOCALID="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port)) for n in (0, 1)]
    r = run_nodes([[grpo] + BASE + ["--out", sl]] * 2, envs)
    if ok(r, "two Slurm tasks"):
        d = differences(rows(ref), rows(sl))
        check(d == [], "two Slurm tasks against --nproc 2:\n  " + "\n  ".join(d[:10]))

    # 3. cuda:LOCAL_RANK, not cuda:RANK. Only where the binary sees no GPU (the message comes before any).
    if not os.path.exists("/dev/nvidia0"):
        cuda = BASE + ["--set", "model.device=cuda"]
        r = run_nodes(launchers(cuda + ["--out", os.path.join(tmp, "cuda2")], free_port()), timeout=120)
        check("grpo_train rank 1: LOCAL_RANK=0 needs cuda:0" in r[1][1] and "cuda:1" not in r[1][1],
              f"node 1's rank asks for another GPU than its node's first:\n{r[1][1][-1500:]}")
        # (Two ranks share this launcher's stderr, their lines may interleave: the message is looked for alone.)
        r = run_nodes([[grpo] + cuda + ["--out", os.path.join(tmp, "cuda1"), "--nproc", "2"]], timeout=120)
        check("LOCAL_RANK=1 needs cuda:1" in r[0][1],
              f"one node's second rank does not ask for cuda:1:\n{r[0][1][-1500:]}")

    # 4. Launches that must fail, at once and saying why.
    quick = BASE + ["--set", "train.dist_timeout_s=3"]
    port = free_port()
    r = run_nodes(launchers(quick + ["--out", os.path.join(tmp, "dup")], port, node_ranks=(0, 0)), timeout=120)
    for i, (rc, err, s) in enumerate(r):
        check(rc == 2, f"both launchers --node-rank 0, launcher {i}: exit {rc}, want 2\n{err[-1500:]}")
        check("--node-rank 0: node 0 is claimed by two launchers" in err,
              f"both launchers --node-rank 0, launcher {i} does not say so:\n{err[-1500:]}")
        check(s < 60, f"both launchers --node-rank 0: launcher {i} took {s:.0f} s")
    # Which of two node-0 launchers binds the port is a race; a store held open here fixes the order: the
    # launcher that cannot bind joins it, and must name the clash once the store's owner claims node 0 after
    # it joined, and name the port (no clash) where the owner never claims.
    try:
        from torch.distributed import TCPStore
    except ImportError:
        TCPStore = None
        print("torch.distributed is not importable: the node-0 launcher that loses the port is not checked")
    if TCPStore is not None:
        for owner_claims in (True, False):
            port = free_port()
            held = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
            late = subprocess.Popen(launchers(quick + ["--out", os.path.join(tmp, f"held{owner_claims}")], port)[0],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLEAN)
            if owner_claims:
                time.sleep(2.0)  # the launcher joins within a second of its start, and waits up to 5 s for a claim
                held.add("rlt/launch/node/0", 1)
            _, err = late.communicate(timeout=120)
            want = ("node 0 is claimed by two launchers" if owner_claims else
                    "node 0's launcher cannot serve the rendezvous store on this machine")
            check(late.returncode == 2 and want in err and
                  (owner_claims or "claimed by two" not in err),
                  f"a node-0 launcher whose port another store holds (owner claims node 0: {owner_claims}): "
                  f"exit {late.returncode}\n{err[-1500:]}")
            del held
    r = run_nodes(launchers(quick + ["--out", os.path.join(tmp, "shape")], free_port(), nnodes=(2, 4)), timeout=120)
    for i, (rc, err, _) in enumerate(r):
        check(rc == 2 and "every node's launcher takes the same --nnodes and --nproc" in err,
              f"--nnodes 2 and 4, launcher {i}: exit {rc}\n{err[-1500:]}")
    r = run_nodes(launchers(quick + ["--out", os.path.join(tmp, "alone")], free_port())[:1], timeout=120)
    rc, err, s = r[0]
    check(rc == 1 and "the launcher of node(s) 1 did not come" in err and s < 60,
          f"node 0 without node 1: exit {rc} after {s:.0f} s\n{err[-1500:]}")
    for flags, want in [(["--nproc", "1", "--nnodes", "2", "--master-port", "29500"], "--nnodes 2 needs --master-addr"),
                        (["--nproc", "1", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port",
                          "29500"], "--node-rank 2: nodes are numbered 0 to 1"),
                        (["--nnodes", "2"], "--nnodes needs --nproc")]:
        b = subprocess.run([grpo] + BASE + ["--out", os.path.join(tmp, "bad")] + flags, capture_output=True,
                           text=True, env=CLEAN, timeout=120)
        check(b.returncode == 2 and want in b.stderr, f"{flags}: exit {b.returncode}, want 2 and '{want}'\n"
                                                      f"{b.stderr[-800:]}")
    b = subprocess.run([grpo] + BASE + ["--out", os.path.join(tmp, "bad")], capture_output=True, text=True,
                       env=dict(CLEAN, SLURM_PROCID="0", SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
                       timeout=120)
    check(b.returncode == 2 and "SLURM_LOCALID is not set" in b.stderr,
          f"a partial Slurm set: exit {b.returncode}\n{b.stderr[-800:]}")

    # 5. A rank killed on node 1 ends node 0's ranks at once, though a collective would wait 600 s.
    killed = os.path.join(tmp, "killed")
    port = free_port()
    argvs = launchers(["--config", tiny] + SMALL + ["--set", "train.steps=60", "--set", "train.dist_timeout_s=600",
                                                    "--out", killed], port)
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLEAN) for a in argvs]
    t0, acted = time.time(), None
    while acted is None and time.time() - t0 < 300 and all(p.poll() is None for p in procs):
        try:
            with open(f"/proc/{procs[1].pid}/task/{procs[1].pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        if kids and os.path.exists(os.path.join(killed, "checkpoint", "state.json")):
            os.kill(kids[0], signal.SIGKILL)
            acted = time.time()
        time.sleep(0.05)
    errs = []
    for p in procs:
        try:
            errs.append(p.communicate(timeout=120)[1])
        except subprocess.TimeoutExpired:
            p.kill()
            errs.append(p.communicate()[1] + "\n[still running 120 s after the kill]")
    check(acted is not None, "node 1's rank was never killed (no checkpoint?)\n" + errs[0][-1500:])
    if acted is not None:
        after = time.time() - acted
        check(after < 30, f"the launchers took {after:.0f} s to end after node 1's rank was killed")
        check(procs[1].returncode == 1 and "node 1: rank 1 was killed by signal 9" in errs[1],
              f"node 1's launcher: exit {procs[1].returncode}\n{errs[1][-1500:]}")
        check(procs[0].returncode == 1 and "node 1: rank 1 was killed by signal 9" in errs[0] and
              "stopping this node's 1 rank(s)" in errs[0],
              f"node 0's launcher: exit {procs[0].returncode}\n{errs[0][-1500:]}")

for f in failures:
    print("FAIL:", f)
print("ok" if not failures else f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
