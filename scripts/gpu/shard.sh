#!/usr/bin/env bash
# The sharded training state on the GPU host, one command; results in $OUT (or runs/gpu_shard).
#   bash scripts/gpu/shard.sh small   the sharding tests, then configs/retool.yaml on a random
#                                     Qwen2.5-0.5B-shaped checkpoint over every GPU of the host, one run per
#                                     train.shard stage: step time split into rollout / update / communication,
#                                     peak memory per GPU (nvidia-smi, sampled every 200 ms)
#   bash scripts/gpu/shard.sh large   a random Qwen2.5-7B-shaped checkpoint (bf16, saved by transformers):
#                                     shard none on one GPU (the memory plan must refuse it before step 1),
#                                     LoRA rank 64 on one GPU, and train.shard parameters over every GPU;
#                                     LARGE_RUNS picks them, with the phase-wise residency runs
#                                     parameters_phase (phase_offload optimizer), parameters_state
#                                     (training_state), parameters_offload_state (with train.offload) and
#                                     parameters_offload_state_host (its optimizer stepped by the host);
#                                     with RANDOM_QWEN=32b, lora_32b and full_32b: configs/retool_32b.yaml
#                                     as shipped on one GPU and fully fine-tuned over every GPU; on one GPU
#                                     also offload_1gpu, phase_1gpu, offload_state_1gpu, keep_1gpu and
#                                     async_1gpu; RANDOM_QWEN (0.5b, 1.5b, 7b, 32b) picks the shape
# Usage: [SHARD_TESTS=0] [STAGES=...] [SHARD_SETS="--set k=v ..."] bash scripts/gpu/shard.sh small|large
#        [steps] [max_new_tokens]
# SHARD_SETS: more settings for every large run (rollout.max_context=512 with max_new_tokens 512 fills
# every cache row to the context the plan counts). Each run's summary has the memory plan beside the
# allocated peaks, per phase: plan_over_peak{,_rollout,_update} = plan / peak - 1.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_shard}
part=${1:-small}
steps=${2:-2}
new_tokens=${3:-1024}
mkdir -p "$out/raw"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The large part runs the trainer only: it builds nothing else; so does the small one with SHARD_TESTS=0
# (its runs without the sharding tests first).
{ [ "$part" = large ] || [ "${SHARD_TESTS:-1}" = 0 ]; } && export RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-grpo_train}
source scripts/gpu/build.sh
ngpu=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
rc=0

# run NAME NPROC ARGS...: one training run with its peak memory per GPU; its metrics, log, exit code and
# memory samples go to $out/raw (archived at the end), its summary at once to $out/summary.json.
run() {
  local name=$1 nproc=$2
  shift 2
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$out/raw/mem_$name.csv" &
  local watcher=$!
  if [ "$nproc" = 1 ]; then
    build-gpu/bin/grpo_train "$@" --out "$out/$name" > "$out/raw/$name.log" 2>&1
  else
    python3 -m torch.distributed.run --nproc-per-node "$nproc" --no-python build-gpu/bin/grpo_train "$@" \
      --out "$out/$name" > "$out/raw/$name.log" 2>&1
  fi
  echo $? > "$out/raw/$name.rc"
  kill $watcher
  cp "$out/$name/metrics.jsonl" "$out/raw/metrics_$name.jsonl" 2>/dev/null
  rm -rf "${out:?}/$name"
  echo "$name: exit $(cat "$out/raw/$name.rc")"
  summary "$name"
}

summary() {
  python3 - "$out" "$@" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
raw = f"{out}/raw"
res = {}
for name in sys.argv[2:]:
    r = {"exit": int(open(f"{raw}/{name}.rc").read())}
    peak = {}
    for line in open(f"{raw}/mem_{name}.csv"):
        try:
            i, mib = (int(x) for x in line.split(","))
        except ValueError:
            continue
        peak[i] = max(peak.get(i, 0), mib)
    r["peak_gpu_mib"] = peak
    path = f"{raw}/metrics_{name}.jsonl"
    rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    steady = rows[1:] or rows  # the first step warms up (graphs, plans)
    keys = ["time_step_s", "memory_allocated_peak_mib", "memory_reserved_peak_mib", "time_rollout_s", "time_update_s", "time_update_comm_wait_s", "sampled_tokens",
            "optimizer_memory_mib", "optimizer_host_memory_mib", "peak_memory_rollout_mib", "peak_memory_update_mib",
            "time_phase_moves_s", "grad_norm", "loss", "memory_plan_mib", "memory_plan_rollout_mib",
            "memory_plan_update_mib", "memory_allocated_peak_rollout_mib", "memory_allocated_peak_scoring_mib",
            "memory_allocated_peak_update_mib"]
    for k in keys:
        vals = [x[k] for x in steady if k in x]
        if vals:
            r[k] = sum(vals) / len(vals)
    # The plan against the allocated peak, per phase (the old and reference log-probs' scoring in the
    # update's) and over the step: plan / peak - 1.
    if "memory_plan_mib" in r and r.get("memory_allocated_peak_mib"):
        r["plan_over_peak"] = r["memory_plan_mib"] / r["memory_allocated_peak_mib"] - 1
        r["plan_over_peak_rollout"] = r["memory_plan_rollout_mib"] / r["memory_allocated_peak_rollout_mib"] - 1
        upd = max(r.get("memory_allocated_peak_scoring_mib", 0), r["memory_allocated_peak_update_mib"])
        r["plan_over_peak_update"] = r["memory_plan_update_mib"] / upd - 1
    if "sampled_tokens" in r and "time_step_s" in r:
        r["sampled_tokens_per_s"] = r["sampled_tokens"] / r["time_step_s"]
    log = open(f"{raw}/{name}.log", errors="replace").read().splitlines()
    r["plan"] = [l.rstrip() for l in log if "GiB" in l][:30]  # the memory plan's lines
    r["log_tail"] = log[-25:]
    res[name] = r
    print(name, json.dumps({k: v for k, v in r.items() if k not in ("log_tail", "plan")}))
prev = {}
if os.path.exists(f"{out}/summary.json"):
    prev = json.load(open(f"{out}/summary.json"))
prev.update(res)
json.dump(prev, open(f"{out}/summary.json", "w"), indent=1)
PY
}

if [ "$part" = small ]; then
  if [ "${SHARD_TESTS:-1}" = 1 ]; then
    (cd build-gpu && ctest --output-on-failure -R "Shard|AdamW|Offload|MemoryPlan|Lora|GradReducer|StoreCollectives") \
      > "$out/ctest.log" 2>&1 || rc=1
    grep -E "tests passed|tests failed|Failed|Skipped" "$out/ctest.log"
  fi
  source scripts/gpu/random_qwen.sh
  common=(--config configs/retool.yaml --set model.path=$ckpt --set data.path=$out/math.jsonl --set data.answer_key=answer
          --set sampling.max_new_tokens=$new_tokens --set train.checkpoint_every=0 --set train.steps=$steps
          --set data.eval_path= --set train.eval_prompts=0)
  # STAGES: which of none optimizer gradients parameters gradients_offload (default: all).
  for stage in ${STAGES:-none optimizer gradients parameters gradients_offload}; do
    if [ "$stage" = gradients_offload ]; then
      run "s05_gradients_offload_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=gradients --set train.offload=optimizer
    else
      run "s05_${stage}_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=$stage
    fi
  done
fi

if [ "$part" = large ]; then
  RANDOM_QWEN=${RANDOM_QWEN:-7b} source scripts/gpu/random_qwen.sh
  tag=s$(echo "${RANDOM_QWEN:-7b}" | tr -d '.b')  # s7, s32, s05, s15: the runs' names
  # A step of 8 prompts x 8 samples, a few hundred new tokens: the 7B's memory, not its learning. The
  # reward (the share of ASCII letters in a response) differs within a group, so the update has a gradient.
  common=(--config configs/retool.yaml --set model.path=$ckpt --set data.path=$out/math.jsonl --set data.answer_key=answer
          --set sampling.max_new_tokens=$new_tokens --set train.checkpoint_every=0 --set train.steps=$steps
          --set data.eval_path= --set train.eval_prompts=0 --set train.prompts_per_step=8 --set train.micro_batch_size=4
          --set reward.kind=python --set reward.script=$PWD/scripts/gpu/letter_reward.py ${SHARD_SETS:-})
  # LARGE_RUNS: which of none_1gpu lora64_1gpu parameters gradients gradients_offload parameters_offload
  # parameters_fixed gradients_fixed, the phase-wise runs of the header, lora_32b and full_32b (default: the
  # 1-GPU runs and the three for 2 GPUs).
  runs=${LARGE_RUNS:-none_1gpu lora64_1gpu parameters gradients_offload parameters_offload}
  for r in $runs; do
    case $r in
      none_1gpu) run "${tag}_none_1gpu" 1 "${common[@]}" ;;
      lora64_1gpu) run "${tag}_lora64_1gpu" 1 "${common[@]}" --set lora.rank=64 --set lora.alpha=128 ;;
      # One GPU: the optimizer state in host memory (train.offload), or parked there while the rollout
      # runs (phase_offload optimizer), or both with the weight chunks (training_state).
      offload_1gpu) run "${tag}_offload_1gpu" 1 "${common[@]}" --set train.offload=optimizer ;;
      phase_1gpu) run "${tag}_phase_1gpu" 1 "${common[@]}" --set train.phase_offload=optimizer ;;
      offload_state_1gpu) run "${tag}_offload_state_1gpu" 1 "${common[@]}" --set train.offload=optimizer \
                            --set train.phase_offload=training_state ;;
      # The rollout's cache and graphs kept through the update, and the rollout beside the update: the plan's
      # phases add up in both.
      keep_1gpu) run "${tag}_keep_1gpu" 1 "${common[@]}" --set rollout.keep_cache=true ;;
      async_1gpu) run "${tag}_async_1gpu" 1 "${common[@]}" --set train.async=one_step ;;
      parameters) run "${tag}_parameters_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=parameters ;;
      gradients) run "${tag}_gradients_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=gradients ;;
      # The trainer's caching allocator grows its segments in place (expandable segments); these runs use
      # fixed-size segments, PyTorch's default, for the comparison.
      parameters_fixed) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
                          run "${tag}_parameters_fixed_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=parameters ;;
      gradients_fixed) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False \
                         run "${tag}_gradients_fixed_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=gradients ;;
      gradients_offload) run "${tag}_gradients_offload_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=gradients \
                           --set train.offload=optimizer ;;
      parameters_offload) run "${tag}_parameters_offload_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=parameters \
                            --set train.offload=optimizer ;;
      parameters_phase) run "${tag}_parameters_phase_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=parameters \
                          --set train.phase_offload=optimizer ;;
      parameters_state) run "${tag}_parameters_state_${ngpu}gpu" "$ngpu" "${common[@]}" --set train.shard=parameters \
                          --set train.phase_offload=training_state ;;
      lora_32b) run s32_lora64_1gpu 1 "${common[@]}" --config configs/retool_32b.yaml ;;
      full_32b) run "s32_full_${ngpu}gpu" "$ngpu" "${common[@]}" --config configs/retool_32b.yaml --set lora.rank=0 \
                  --set train.shard=parameters --set train.offload=optimizer --set train.phase_offload=training_state ;;
      parameters_offload_state) run "${tag}_parameters_offload_state_${ngpu}gpu" "$ngpu" "${common[@]}" \
                                  --set train.shard=parameters --set train.offload=optimizer \
                                  --set train.phase_offload=training_state ;;
      # The same with the optimizer stepped by the host's cores (train.offload_step auto streams it through
      # each GPU when several ranks share a host).
      parameters_offload_state_host) run "${tag}_parameters_offload_state_host_${ngpu}gpu" "$ngpu" "${common[@]}" \
                                       --set train.shard=parameters --set train.offload=optimizer \
                                       --set train.offload_step=host --set train.phase_offload=training_state ;;
    esac
  done
  [ "${RANDOM_QWEN_KEEP:-0}" = 1 ] || rm -rf "$ckpt"
fi
rm -f "$out/math.jsonl"
(cd "$out" && tar czf raw.tgz --remove-files raw)
exit $rc
