#!/usr/bin/env bash
# The rollout engine on the GPU host: build; every test (ctest: on CUDA, DecodeEngine replays
# CUDA graphs through holes and compaction against float64 full forwards);
# bench_model (64 x (256 prompt + 512 new), sampling, random Qwen2.5-0.5B shape;
# 3 reps, the median; plus a Kineto trace of each mode split by phase: trace_summary.txt)
# beside transformers generate in the same command; then grpo_train --config configs/retool.yaml for
# STEPS steps (default 1) of MAX_NEW tokens per turn (default 512) on a transformers-saved random
# checkpoint (scripts/gpu/train.sh, switches on only); bench_rollout: the ReTool loop with sandboxed tool
# calls beside plain decoding through the same loop, its feed modes, and continuous batching against
# waves (--refill 2) (SKIP_LOOP=1 skips it); with ROWS_SWEEP="16 64 256", the decode step's time against
# its rows: bench_model --modes rollout_graph at each batch (256 + 256 tokens; rows_<B>.json); with
# LOOP_LARGE=1, the loop at a batch of 256 trajectories, 256 + 2048 tokens, a call every 384 free
# samples (loop_large.json: plain, the eager and kept-graph tools modes, calls at once and spread).
# Results land in $OUT (or runs/gpu_rollout). Env: STEPS, MAX_NEW, TRAIN_TIMEOUT (s), SKIP_CTEST=1,
# SKIP_BENCH=1, SKIP_TRAIN=1, EAGER_ROLLOUT=1 (one more trainer step with the rollout's graphs off),
# FEED_AB=1 (the steps again with tool replies fed one token per step), PRESTART_AB=1 and NICE_AB=1 (below).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_rollout}
mkdir -p "$out"
source scripts/gpu/build.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv > "$out/gpu.txt" 2>&1
# Every test (ctest runs the fixtures that make the transformers references), CUDA ones included.
if [ "${SKIP_CTEST:-0}" != 1 ]; then
  run_gpu_ctest || ctest_failed=1
fi
model=configs/models/qwen2.5-0.5b
[ "${SKIP_BENCH:-0}" = 1 ] || build-gpu/bin/bench_model --model $model --device cuda --dtype bfloat16 --batch 64 --prompt-len 256 \
  --new-tokens 512 --reps 3 --trace "$out/trace.json" --json "$out/rlt.json" 2>&1 | tee -a "$out/bench.log"
# The trace (tens of MB) stays on the host: its per-phase summary comes back.
if [ -f "$out/trace.json" ]; then
  python3 scripts/dev/trace_summary.py "$out/trace.json" --top 15 --json "$out/trace_summary.json" > "$out/trace_summary.txt"
  rm -f "$out/trace.json"
fi
[ "${SKIP_BENCH:-0}" = 1 ] || python3 scripts/bench_model_peers.py --model $model --device cuda --dtype bfloat16 --batch 64 --prompt-len 256 \
  --new-tokens 512 --reps 3 --json "$out/hf.json" 2>&1 | tee -a "$out/bench.log"
# The ReTool loop with sandboxed tool calls (steered: a call every 96 free samples) beside plain decoding
# through the same loop, 64 x (256 + 512), the sandbox as configs/retool.yaml has it.
[ "${SKIP_LOOP:-0}" = 1 ] || build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" \
  --device cuda --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
  --refill 2 --json "$out/loop.json" 2>&1 | tee -a "$out/loop.log"
if [ "${LOOP_LARGE:-0}" = 1 ]; then
  build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" --device cuda \
    --dtype bfloat16 --batch 256 --prompt-len 256 --new-tokens 2048 --tool-every 384 --workers 16 \
    --modes tools_eager,spread_eager,tools_kept,spread_kept --json "$out/loop_large.json" 2>&1 | tee -a "$out/loop_large.log"
fi
# PRESTART_AB=1: the tools modes with the sandbox's interpreters started cold and prestarted
# (sandbox.prestart), alternating twice at 64 rows (prestart_<run>.json), then once each at 256 rows of
# 256 + 1024 tokens, a call every 256 free samples (prestart_large_<run>.json).
if [ "${PRESTART_AB:-0}" = 1 ]; then
  for run in cold1 warm1 cold2 warm2; do
    p=true; [ "${run#cold}" != "$run" ] && p=false
    build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" --device cuda \
      --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 --prestart $p \
      --modes tools_eager,spread_eager,tools_kept,spread_kept --json "$out/prestart_$run.json" 2>&1 | tee -a "$out/prestart.log"
  done
  for run in cold warm; do
    p=true; [ "$run" = cold ] && p=false
    build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" --device cuda \
      --dtype bfloat16 --batch 256 --prompt-len 256 --new-tokens 1024 --tool-every 256 --workers 16 --prestart $p \
      --modes tools_kept,spread_kept --json "$out/prestart_large_$run.json" 2>&1 | tee -a "$out/prestart.log"
  done
fi
# NICE_AB=1: the tools modes with the sandbox's interpreters at the trainer's priority (sandbox.nice 0)
# and below it (10), prestarted, alternating twice at 64 rows (nice_<run>.json), then once
# each at 256 rows of 256 + 1024 tokens (nice_large_<run>.json).
if [ "${NICE_AB:-0}" = 1 ]; then
  for run in n0_1 n10_1 n0_2 n10_2; do
    n=${run#n}; n=${n%_*}
    build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" --device cuda \
      --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 --nice $n \
      --modes tools_eager,tools_kept,spread_kept --json "$out/nice_$run.json" 2>&1 | tee -a "$out/nice.log"
  done
  for n in 0 10; do
    build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" --device cuda \
      --dtype bfloat16 --batch 256 --prompt-len 256 --new-tokens 1024 --tool-every 256 --workers 16 --nice $n \
      --modes tools_kept,spread_kept --json "$out/nice_large_n$n.json" 2>&1 | tee -a "$out/nice.log"
  done
fi
for rows in ${ROWS_SWEEP:-}; do
  build-gpu/bin/bench_model --model $model --device cuda --dtype bfloat16 --batch "$rows" --prompt-len 256 \
    --new-tokens 256 --reps 3 --modes rollout_graph --json "$out/rows_$rows.json" 2>&1 | tee -a "$out/rows.log"
done
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  OUT="$out/train" SKIP_UPDATE_BENCH=1 SKIP_OFF=1 bash scripts/gpu/train.sh "${STEPS:-1}" "${MAX_NEW:-512}"
fi
ls -la "$out"
# The script's status: a failed or skipped test fails the script, after the benchmarks have run.
exit "${ctest_failed:-0}"
