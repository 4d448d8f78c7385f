#!/usr/bin/env bash
# The policy update against the GPU's bf16 rate on the GPU host: build, run the packed forward's tests
# (the CUDA case compares the varlen flash path with the padded one) and the engine's, then bench_update
# with the configs/retool.yaml loss settings (cce_response_mask, checkpointing on) in both layouts,
# right-padded rows and sequences packed end to end, each update traced (kernel families, GPU-idle
# time, the longest kernels):
#   - the end-to-end peer's shape: the 0.5B, 256 sequences of a 192-token prompt and 512 response tokens
#     in micro-batches of 8 (scripts/gpu/e2e_peer.sh's random checkpoint samples every token it may);
#   - the same with response lengths drawn from 32 to 512, as a trained model's vary;
#   - both again in micro-batches of 32 (about 22k tokens; launches a token cost less);
#   - the 1.5B and the 7B at 16 sequences of up to 4,096 tokens (lengths from 1,024), micro-batches of 4.
# Each in both kernel sets with KERNELS=fused,aten: the fused RMSNorm, RoPE and SiLU-gate kernels with
# their backwards (the default), and the ATen forms.
# Results land in $OUT (or runs/gpu_update). TESTS=0 skips the tests, LONG=0 the 1.5B and the 7B;
# LAYOUTS (padded,packed), MICROS ("8 32") and KERNELS (fused) narrow the runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_update}
mkdir -p "$out"
tests=${TESTS:-1}
targets="bench_update"
[ "$tests" = 1 ] && targets="$targets test_transformer test_batch test_engine test_train_kernels test_decode_kernels"
export RLT_BUILD_TARGETS="${RLT_BUILD_TARGETS:-$targets}"
source scripts/gpu/build.sh
rc=0
if [ "$tests" = 1 ]; then
  (cd build-gpu && ctest -R "make_model_references|Packed|TrainKernels|TrainingKernels|DecodeKernels" \
    --output-on-failure) > "$out/packed_tests.log" 2>&1 || rc=1
  grep -E "tests passed|tests failed" "$out/packed_tests.log"
  (cd build-gpu && ./bin/test_transformer --gtest_filter='*PackedBf16*:*TrainingKernels*') 2>&1 |
    grep -E "packed bf16|training kernels|OK|FAILED|SKIPPED"
  build-gpu/bin/test_engine > "$out/test_engine.log" 2>&1 || rc=1
  echo "test_engine: $(grep -E '^\[  (PASSED|FAILED) ' "$out/test_engine.log" | tr '\n' ' ')"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
bench() {  # NAME ARGS...
  local name=$1
  shift
  build-gpu/bin/bench_update --device cuda --dtype bfloat16 --only cce_response_mask --reps "${REPS:-2}" --trace-top 12 \
    --layouts "${LAYOUTS:-padded,packed}" --kernels "${KERNELS:-fused}" --json "$out/$name.json" "$@" 2>&1 |
    tee "$out/$name.log"
}
for micro in ${MICROS:-8 32}; do
  bench "e2e_fixed_m$micro" --model configs/models/qwen2.5-0.5b --batch 256 --micro $micro --seq-len 704 \
    --prompt-len 192
  bench "e2e_varied_m$micro" --model configs/models/qwen2.5-0.5b --batch 256 --micro $micro --seq-len 704 \
    --prompt-len 192 --min-response 32
done
[ "${LONG:-1}" = 1 ] || exit $rc
bench long_1.5b --model configs/models/qwen2.5-1.5b --batch 16 --micro 4 --seq-len 4096 --prompt-len 256 \
  --min-response 1024
REPS=1 bench long_7b --model configs/models/qwen2.5-7b --batch 16 --micro 4 --seq-len 4096 --prompt-len 256 \
  --min-response 1024
exit $rc
