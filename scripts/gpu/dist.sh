#!/usr/bin/env bash
# Data-parallel training on the GPU host, one command; results in $OUT (or runs/gpu_dist):
#   1. tests: the data-parallel tests (NCCL from the autograd engine's device thread, the CPU launch tests);
#   2. nproc1: one rank through the launched path (--nproc 1: TCPStore, NCCL, every collective staged
#      through the GPU) against the plain single process: the same metrics, bit for bit (times aside);
# with two GPUs or more on the host, also
#   3. eq: equivalence in fp32, configs/retool_gpu.yaml on N ranks (torchrun --nproc-per-node N; EQ_NPROC,
#      default 2 and every GPU of the host) against 1, same seed, for each train.shard stage in EQ_STAGES
#      (default none): first-step loss and gradient norm within 1e-5, the weights after 3 steps within 1e-4
#      relative;
#   4. scale: configs/retool.yaml steps (random Qwen2.5-0.5B-shaped checkpoint saved by transformers) on 1
#      GPU and on SCALE_NPROC (default every GPU of the host), the step time split into rollout / scoring /
#      update / gradient communication; SCALE_SET adds --set arguments to both runs.
# Usage: [PARTS="tests nproc1 eq scale"] bash scripts/gpu/dist.sh [scaling_steps] [max_new_tokens];
# CTEST_ALL=1 also runs every test.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_dist}
steps=${1:-3}
new_tokens=${2:-2048}
mkdir -p "$out"
# NVLink multicast stays off in every process (the device host's rule: it can take shared GPUs out of
# service); the ranks inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPU_REBUILD=${GPU_REBUILD:-0} source scripts/gpu/build.sh
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
parts=" ${PARTS:-tests nproc1 eq scale} "
want() { [[ "$parts" == *" $1 "* ]]; }
rc=0
# The runs' metrics stay as $out/metrics_<run>.jsonl; their folders (checkpoints) go.
tidy() {
  local d
  for d in warm plain plain2 nproc1 eq1 $(cd "$out" && ls -d eq[0-9]*_* scale[0-9]* 2>/dev/null); do
    [ -d "$out/$d" ] || continue
    cp "$out/$d/metrics.jsonl" "$out/metrics_$d.jsonl" 2>/dev/null
    rm -rf "${out:?}/$d"
  done
  # Few files to bring back: the comparisons and the scaling summary stay beside one archive of
  # every log and metrics file.
  grep -E "tests passed|tests failed|Failed|Skipped" "$out"/ctest*.log > "$out/ctest_summary.txt" 2>/dev/null
  (cd "$out" && tar czf raw.tgz --remove-files $(ls metrics_*.jsonl *.log math.jsonl 2>/dev/null))
}

# 1. The tests.
if want tests; then
  (cd build-gpu && ctest --output-on-failure -R "GradReducer|DistEnv|RankPrompts|StoreCollectives|MiniBatchDenominators|GatherTable|CheckWorld|TwoRanks|dist_launch") \
    > "$out/ctest.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed|Failed|Skipped" "$out/ctest.log"
  if grep -qE "Skipped.*Cuda" "$out/ctest.log"; then echo "a CUDA test skipped on a GPU host"; rc=1; fi
fi

# compare A B TOL: the metrics of two runs, step by step.
compare() {
  python3 - "$@" <<'PY'
import json, sys
a, b, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
ra = [json.loads(l) for l in open(a)]
rb = [json.loads(l) for l in open(b)]
bad = 0
exact = ["reward_mean", "sampled_tokens", "tokens", "accuracy", "response_length_max"]
# Step 1 must agree (the same rollout exactly; loss and gradient norm within tol); later steps are shown.
for x, y in zip(ra, rb):
    first = x["step"] == 1
    for k in exact:
        if x.get(k) != y.get(k):
            print(f"step {x['step']}: {k} {x.get(k)} != {y.get(k)}"); bad += first
    for k in ("loss", "grad_norm"):
        d = abs(x[k] - y[k]) / (max(abs(x[k]), 1e-30) if k == "grad_norm" else 1)
        print(f"step {x['step']}: {k} {x[k]:.9g} vs {y[k]:.9g}: {'relative ' if k == 'grad_norm' else ''}difference {d:.3g}")
        bad += first and d > tol
print(f"{len(ra)} and {len(rb)} steps compared, {bad} mismatch(es)")
sys.exit(1 if bad or len(ra) != len(rb) else 0)
PY
}

# Training on the GPU is not bit-reproducible from run to run (attention and CCE backward accumulate with
# atomics), so the runs compared start from one warmed-up checkpoint (sft.steps=0 then): their first
# rollouts and first losses are forward passes of the same weights.
if want nproc1 || want eq; then
  build-gpu/bin/grpo_train --config configs/retool_gpu.yaml --set sft.steps=300 --set train.steps=1 \
    --set train.eval_prompts=0 --out "$out/warm" > "$out/warm.log" 2>&1 || rc=1
fi
start=(--config configs/retool_gpu.yaml --set model.path=$out/warm/checkpoint/model --set sft.steps=0
       --set train.eval_prompts=0 --set train.checkpoint_every=0)

# 2. One rank through the launched path (TCPStore, NCCL) against the plain process, fp32, with a second
# plain run as the control: step 1 alike (the rollout and the loss exactly, the gradient norm within 1e-5,
# the noise of the backward's atomics; in bf16 that noise alone measured 1.5e-5).
if want nproc1; then
  one=("${start[@]}" --set model.dtype=float32 --set train.steps=2)
  build-gpu/bin/grpo_train "${one[@]}" --out "$out/plain" > "$out/plain.log" 2>&1 || rc=1
  build-gpu/bin/grpo_train "${one[@]}" --out "$out/plain2" > "$out/plain2.log" 2>&1 || rc=1
  build-gpu/bin/grpo_train "${one[@]}" --out "$out/nproc1" --nproc 1 > "$out/nproc1.log" 2>&1 || rc=1
  {
    echo "== control: two plain runs"
    compare "$out/plain/metrics.jsonl" "$out/plain2/metrics.jsonl" 1e-5
    echo "== --nproc 1 (NCCL, one rank) against one process"
    compare "$out/plain/metrics.jsonl" "$out/nproc1/metrics.jsonl" 1e-5
  } 2>&1 | tee "$out/nproc1_compare.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi

# CTEST_ALL=1: every test of the tree too (run_gpu_ctest: a skipped CUDA test fails it).
if [ "${CTEST_ALL:-0}" = 1 ]; then
  [ -f "$out/ctest.log" ] && mv "$out/ctest.log" "$out/ctest_dist.log"
  run_gpu_ctest || rc=1
fi

if [ "$ngpu" -lt 2 ]; then
  echo "$ngpu GPU: parts 3 and 4 need two"
  tidy
  exit $rc
fi

# 3. Equivalence in fp32: N ranks x 32/N prompts against 1 x 32, same seed and start, 3 steps, per shard stage.
if want eq; then
  eq=("${start[@]}" --set model.dtype=float32 --set train.steps=3)
  build-gpu/bin/grpo_train "${eq[@]}" --out "$out/eq1" > "$out/eq1.log" 2>&1 || rc=1
  rm -f "$out/eq_compare.txt"
  nprocs=${EQ_NPROC:-$( [ "$ngpu" -gt 2 ] && echo "2 $ngpu" || echo 2 )}
  for n in $nprocs; do
    for stage in ${EQ_STAGES:-none}; do
      name=eq${n}_$stage
      python3 -m torch.distributed.run --nproc-per-node "$n" --no-python build-gpu/bin/grpo_train "${eq[@]}" \
        --set train.shard=$stage --out "$out/$name" > "$out/$name.log" 2>&1 || rc=1
      echo "== equivalence (fp32): torchrun --nproc-per-node $n, train.shard $stage, against one GPU" \
        | tee -a "$out/eq_compare.txt"
      compare "$out/eq1/metrics.jsonl" "$out/$name/metrics.jsonl" 1e-5 | tee -a "$out/eq_compare.txt" || rc=1
      python3 - "$out/eq1/checkpoint/model" "$out/$name/checkpoint/model" <<'PY' | tee -a "$out/eq_compare.txt" || rc=1
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1] + "/model.safetensors"), load_file(sys.argv[2] + "/model.safetensors")
num = sum((a[k].double() - b[k].double()).square().sum().item() for k in a)
den = sum(a[k].double().square().sum().item() for k in a)
rel = (num / den) ** 0.5
print(f"weights after 3 steps: ||W_N - W_1|| / ||W_1|| = {rel:.3g} (target <= 1e-4)")
sys.exit(0 if rel <= 1e-4 else 1)
PY
    done
  done
fi

# 4. Scaling: configs/retool.yaml on 1 and N GPUs, same prompts.
want scale || { tidy; exit $rc; }
source scripts/gpu/random_qwen.sh
n=${SCALE_NPROC:-$ngpu}
if [ "$n" -lt 2 ]; then
  echo "SCALE_NPROC=$n: scaling compares 1 GPU with 2 or more"
  tidy
  exit 1
fi
common=(--config configs/retool.yaml --set model.path=$ckpt --set data.path=$out/math.jsonl --set data.answer_key=answer
        --set sampling.max_new_tokens=$new_tokens --set train.checkpoint_every=0 --set train.steps=$steps
        --set data.eval_path= --set train.eval_prompts=0 ${SCALE_SET:-})
build-gpu/bin/grpo_train "${common[@]}" --out "$out/scale1" > "$out/scale1.log" 2>&1 || rc=1
python3 -m torch.distributed.run --nproc-per-node "$n" --no-python build-gpu/bin/grpo_train "${common[@]}" \
  --out "$out/scale$n" > "$out/scale$n.log" 2>&1 || rc=1
python3 - "$out" "$n" <<'PY' | tee "$out/scaling.txt"
import json, sys
out, gpus = sys.argv[1], int(sys.argv[2])
def rows(n):
    return [json.loads(l) for l in open(f"{out}/scale{n}/metrics.jsonl")]
keys = ["time_step_s", "time_rollout_s", "time_scoring_s", "time_update_s", "time_update_comm_wait_s", "sampled_tokens"]
summary = {}
for n in (1, gpus):
    r = rows(n)[1:] or rows(n)  # the first step warms up (graphs, cuDNN plans)
    summary[n] = {k: sum(x.get(k, 0.0) for x in r) / len(r) for k in keys}
    s = summary[n]
    print(f"{n} GPU: step {s['time_step_s']:.2f} s = rollout {s['time_rollout_s']:.2f} + scoring {s['time_scoring_s']:.2f}"
          f" + update {s['time_update_s']:.2f} (gradient wait {s['time_update_comm_wait_s']:.3f}); "
          f"{s['sampled_tokens'] / s['time_step_s']:.0f} sampled tokens/s")
for k in ("time_step_s", "time_rollout_s", "time_update_s"):
    print(f"{k}: {gpus} GPUs over 1: {summary[1][k] / summary[gpus][k]:.2f}x")
json.dump(summary, open(f"{out}/scaling.json", "w"), indent=1)
PY
tidy
exit $rc
