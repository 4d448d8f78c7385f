#!/usr/bin/env bash
# The trainer on the GPU host: build, then
#   1. bench_update beside scripts/bench_update_peer.py (transformers): one GRPO policy update of
#      B=8 x L=4096 on a random Qwen2.5-0.5B-shaped model under every memory setting;
#   2. grpo_train --config configs/retool.yaml for a few steps on a random Qwen2.5-0.5B-shaped checkpoint
#      saved by transformers and a small math JSONL, with the memory switches on, then one step with
#      them off (rollout tokens/s, update tokens/s, peak memory from metrics.jsonl).
# Results land in $OUT (or runs/gpu_train). Usage: bash scripts/gpu/train.sh [steps] [max_new_tokens]
# SKIP_UPDATE_BENCH=1 skips part 1; SKIP_OFF=1 skips the switches-off run; EAGER_ROLLOUT=1 adds one step
# with the rollout's CUDA graphs off; KERNELS_AB=1 adds one step with rollout.fused_kernels and
# rollout.packed_weights off; FEED_AB=1 repeats the steps with rollout.multi_token_feed off;
# TRAIN_TIMEOUT=S bounds each grpo_train run (default: none).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_train}
steps=${1:-3}
new_tokens=${2:-8192}
mkdir -p "$out"
GPU_REBUILD=${GPU_REBUILD:-0} source scripts/gpu/build.sh  # builds only where nothing is built yet
model=configs/models/qwen2.5-0.5b
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > "$out/gpu.txt" 2>&1

# 1. The update, ours then transformers', twice (round 1 warms the GPU clocks; round 2 is recorded).
for round in 1 2; do
  [ "${SKIP_UPDATE_BENCH:-0}" = 1 ] && break
  build-gpu/bin/bench_update --model $model --device cuda --dtype bfloat16 --batch 8 --seq-len 4096 \
    --prompt-len 256 --tool-fraction 0.2 --reps 3 --layouts padded \
    --json "$out/update_rlt.round$round.json" 2>&1 | tee -a "$out/bench_update.log"
  python3 scripts/bench_update_peer.py --model $model --batch 8 --seq-len 4096 --prompt-len 256 \
    --tool-fraction 0.2 --reps 3 --json "$out/update_hf.round$round.json" 2>&1 | tee -a "$out/bench_update.log"
done

# 2. A random checkpoint saved by transformers ($ckpt), and a small math dataset ($out/math.jsonl).
source scripts/gpu/random_qwen.sh
common=(--config configs/retool.yaml --set model.path=$ckpt --set data.path=$out/math.jsonl --set data.answer_key=answer
        --set sampling.max_new_tokens=$new_tokens --set train.checkpoint_every=0
        --set data.eval_path="$RLT_FIXTURES_DIR/data/aime2024.jsonl" --set train.eval_prompts=8 --set train.eval_samples=4
        --set train.eval_every=$steps)
limit=(); [ -n "${TRAIN_TIMEOUT:-}" ] && limit=(timeout "$TRAIN_TIMEOUT")
"${limit[@]}" build-gpu/bin/grpo_train "${common[@]}" --set train.steps=$steps --out "$out/run_on" 2>&1 | tail -n 30 | tee "$out/train_on.log"
[ "${SKIP_OFF:-0}" = 1 ] || "${limit[@]}" build-gpu/bin/grpo_train "${common[@]}" --set train.steps=1 --set loss.impl=naive --set loss.response_only=false \
  --set loss.loss_mask_only=false --set model.activation_checkpointing=false --out "$out/run_off" 2>&1 | tail -n 30 | tee "$out/train_off.log"
# EAGER_ROLLOUT=1: one more step with the switches on and the rollout's CUDA graphs off (same prompts).
[ "${EAGER_ROLLOUT:-0}" = 1 ] && "${limit[@]}" build-gpu/bin/grpo_train "${common[@]}" --set train.steps=1 \
  --set rollout.cuda_graphs=false --out "$out/run_eager" 2>&1 | tail -n 30 | tee "$out/train_eager.log"
# KERNELS_AB=1: one more step with the rollout's fused kernels and packed weights off (same prompts).
[ "${KERNELS_AB:-0}" = 1 ] && "${limit[@]}" build-gpu/bin/grpo_train "${common[@]}" --set train.steps=1 \
  --set rollout.fused_kernels=false --set rollout.packed_weights=false --out "$out/run_aten" 2>&1 | tail -n 30 | tee "$out/train_aten.log"
# FEED_AB=1: the same steps again with tool replies fed one token per decode step (the same prompts).
[ "${FEED_AB:-0}" = 1 ] && "${limit[@]}" build-gpu/bin/grpo_train "${common[@]}" --set train.steps=$steps \
  --set rollout.multi_token_feed=false --out "$out/run_onetoken" 2>&1 | tail -n 30 | tee "$out/train_onetoken.log"
for r in on off eager aten onetoken; do cp "$out/run_$r/metrics.jsonl" "$out/metrics_$r.jsonl" 2>/dev/null; done
rm -rf "$out/run_on" "$out/run_off" "$out/run_eager" "$out/run_aten" "$out/run_onetoken"
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
recs = []
for f in sorted(glob.glob(os.path.join(out, "update_*.json"))):
    for r in json.load(open(f)):
        r["round"] = int(f.split("round")[1].split(".")[0])
        recs.append(r)
    os.remove(f)
json.dump(recs, open(os.path.join(out, "bench_update.json"), "w"), indent=1)
PY
ls -la "$out"
