#!/usr/bin/env bash
# The decode step's cost table on the GPU host: build, run the decode kernels', the engine's and the
# sampler's tests (CUDA cases included), then bench_step over the random Qwen2.5 0.5B, 1.5B and 7B shapes
# (configs/models), rows 1, 16, 64 and 256 at contexts 512 and 2,048, each cell against its weight-read
# floor: the rollout's path, and the same with one part of it off (--variants; VARIANTS, default the graph's
# kernels without programmatic edges); then the kernels that take the most time a step, at 16 rows x 512
# (--top-kernels). MODELS narrows the shapes (default 0.5b,1.5b,7b). Results land in $OUT (or
# runs/gpu_step). A first pass over the 0.5B's cells warms the GPU (it idles at a low clock and ramps
# with load); the second is the one recorded.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_step}
mkdir -p "$out"
export RLT_BUILD_TARGETS="${RLT_BUILD_TARGETS:-bench_step bench_model test_decode_kernels test_engine test_sampler test_retool}"
source scripts/gpu/build.sh
rc=0
for t in test_decode_kernels test_engine test_sampler test_retool; do
  build-gpu/bin/$t > "$out/$t.log" 2>&1 || rc=1
  echo "$t: $(grep -E '^\[  (PASSED|FAILED) ' "$out/$t.log" | tr '\n' ' ') $(grep -cE '^\[  SKIPPED \] .*[Cc]uda' "$out/$t.log") CUDA skipped"
done
grep -E "^top_p" "$out/test_engine.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
build-gpu/bin/bench_step --models configs/models/qwen2.5-0.5b --steps 16 --reps 1 --trace-steps 0 > /dev/null
models=$(echo "${MODELS:-0.5b,1.5b,7b}" | sed -E 's#([^,]+)#configs/models/qwen2.5-\1#g')
build-gpu/bin/bench_step --models "$models" \
  --variants "${VARIANTS:-default,no_dependent_launch}" --json "$out/step_cost.json" 2>&1 | tee "$out/step_cost.log"
build-gpu/bin/bench_step --models "$models" \
  --rows 16 --contexts 512 --steps 16 --reps 2 --top-kernels 14 --variants "${VARIANTS:-default,no_dependent_launch}" \
  --json "$out/step_kernels.json" > "$out/step_kernels.log" 2>&1
exit $rc
