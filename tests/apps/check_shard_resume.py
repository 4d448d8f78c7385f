"""grpo_train with a sharded training state on the CPU (real processes, the store's collectives):

1. --nproc 2 with train.shard gradients trains 3 steps as the replicated --nproc 2 run does: the same
   rollouts (rewards, token counts) and, the sums over ranks taken in another order, the loss and the
   gradient norm within 1e-5 relative.
2. The same run stopped after 2 steps (--stop-after) and resumed on 3 ranks with train.shard parameters
   continues as the uninterrupted run went on: step 3 alike, within the same bounds. The checkpoint holds
   one optimizer-<rank>.safetensors per rank of the run that wrote it.
3. A replicated run resumes the sharded checkpoint (and the other way round) alike.
4. A resume whose optimizer pieces were deleted exits with code 2, naming the file it needs.
5. The warm-up (its own AdamW) trains under train.shard gradients as it does replicated: the first RL
   step after it samples the same rollouts.

usage: check_shard_resume.py GRPO_TRAIN SOURCE_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

grpo, src = sys.argv[1:3]
tiny = os.path.join(src, "configs", "retool_tiny.yaml")
failures = []
# Every run starts from one warmed-up checkpoint (the parameters stage takes no warm-up of its own: it
# trains whole weights only through its sharded optimizer), so rewards vary and gradients flow. 6 prompts:
# whole prompts split over 2 and 3 ranks; the layers recompute in the backward, as that stage needs.
# The warm-up's traces all call the tool, so the tool-use shaping of the reward varies within a group.
WARM = ["--set", "model.init_hidden=64", "--set", "model.init_layers=2", "--set", "model.init_heads=2",
        "--set", "model.init_kv_heads=1", "--set", "model.init_intermediate=128", "--set", "model.tokenizer_vocab=320",
        "--set", "sft.steps=200", "--set", "sft.tool_fraction=1.0", "--set", "train.steps=1",
        "--set", "train.eval_prompts=0"]
SMALL = ["--set", "sft.steps=0", "--set", "train.prompts_per_step=6", "--set", "sampling.samples_per_prompt=4",
         "--set", "sampling.max_new_tokens=48", "--set", "train.eval_prompts=0", "--set", "train.steps=3",
         "--set", "model.activation_checkpointing=true", "--set", "train.lr=1e-3", "--set", "train.micro_batch_size=4"]


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def train(out, *args, expect=0, base=None):
    cmd = [grpo, "--config", tiny, *(base if base is not None else SMALL), "--out", out, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != expect:
        print(" ".join(cmd), "\n", p.stderr[-3000:])
    check(p.returncode == expect, f"{' '.join(args)}: exit {p.returncode}, expected {expect}")
    return p


def differences(a, b, what, steps=None):
    ra, rb = rows(a), rows(b)
    if steps is not None:
        ra, rb = [r for r in ra if r["step"] in steps], [r for r in rb if r["step"] in steps]
    out = [] if len(ra) == len(rb) and ra else [f"{what}: {len(ra)} against {len(rb)} steps"]
    for x, y in zip(ra, rb):
        for k in ("reward_mean", "sampled_tokens", "tokens"):
            if x.get(k) != y.get(k):
                out.append(f"{what}: step {x['step']} {k} {x.get(k)} != {y.get(k)}")
        for k in ("loss", "grad_norm"):
            d = abs(x[k] - y[k]) / max(abs(y[k]), 1e-12)
            if d > 1e-5:
                out.append(f"{what}: step {x['step']} {k} {x[k]!r} vs {y[k]!r} (relative {d:.3g})")
    return out


def varied(run_dir):
    return any(r["grad_norm"] > 0 for r in rows(run_dir))


def same_steps(a, b, what, steps=None):
    for problem in differences(a, b, what, steps):
        check(False, problem)


with tempfile.TemporaryDirectory() as tmp:
    d = lambda name: os.path.join(tmp, name)
    train(d("warm"), base=WARM)
    SMALL += ["--set", "model.path=" + os.path.join(d("warm"), "checkpoint", "model")]
    train(d("replicated"), "--nproc", "2")
    train(d("gradients"), "--nproc", "2", "--set", "train.shard=gradients")
    # Not vacuous: some step has a gradient (a group's rewards vary), and the twin below differs.
    check(varied(d("replicated")), "some step of the replicated run has a gradient (rewards vary)")
    same_steps(d("gradients"), d("replicated"), "gradients on 2 ranks against replicated")
    # The comparison can fail: a run at another learning rate differs by step 3.
    train(d("lr_twin"), "--nproc", "2", "--set", "train.shard=gradients", "--set", "train.lr=2e-3")
    check(differences(d("lr_twin"), d("replicated"), "twin", steps={3}),
          "a run with another learning rate must differ at step 3 (the comparison can fail)")

    train(d("resumed"), "--nproc", "2", "--set", "train.shard=gradients", "--stop-after", "2")
    ckpt = os.path.join(d("resumed"), "checkpoint")
    pieces = sorted(f for f in os.listdir(ckpt) if f.startswith("optimizer-"))
    check(pieces == ["optimizer-0.safetensors", "optimizer-1.safetensors"], f"pieces of 2 ranks: {pieces}")
    train(d("resumed"), "--nproc", "3", "--set", "train.shard=parameters", "--resume")
    same_steps(d("resumed"), d("gradients"), "2 ranks (gradients) resumed on 3 (parameters)", steps={3})

    train(d("to_replicated"), "--nproc", "2", "--set", "train.shard=gradients", "--stop-after", "2")
    train(d("to_replicated"), "--resume")
    same_steps(d("to_replicated"), d("gradients"), "gradients on 2 ranks resumed replicated on 1", steps={3})
    train(d("from_replicated"), "--stop-after", "2")
    train(d("from_replicated"), "--nproc", "3", "--set", "train.shard=optimizer", "--resume")
    same_steps(d("from_replicated"), d("replicated"), "replicated resumed on 3 ranks (optimizer)", steps={3})

    train(d("lost"), "--nproc", "2", "--set", "train.shard=gradients", "--stop-after", "1")
    for f in os.listdir(os.path.join(d("lost"), "checkpoint")):
        if f.startswith("optimizer-"):
            os.remove(os.path.join(d("lost"), "checkpoint", f))
    p = train(d("lost"), "--nproc", "2", "--set", "train.shard=gradients", "--resume", expect=2)
    check("optimizer-" in p.stderr, f"the error names the missing optimizer state: {p.stderr[-400:]}")

    train(d("warm_replicated"), "--nproc", "2", base=WARM)
    train(d("warm_sharded"), "--nproc", "2", "--set", "train.shard=gradients", base=WARM)
    same_steps(d("warm_sharded"), d("warm_replicated"), "a warm-up under train.shard gradients")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("sharded runs and resumes agree")
