#!/usr/bin/env bash
# Speculative rollouts (rollout.speculative: suffix) on one GPU: the CUDA tests of the verifying forward
# (DecodeEngine::extend_each and retract on replayed feed graphs; the speculative rollouts' tests), then
# bench_rollout on a random Qwen2.5-0.5B shape (bf16, prompt 256, 512 new tokens) at BATCHES rows (default
# "16 64"), each batch one process running its modes in turn, with and without speculation: plain and
# plain_spec (tools off: random text, where drafts rarely match: the overhead), tools and tools_spec (a
# steered code call every 96 free samples: each call's script repeats the row's earlier ones, so drafts
# of it are taken), and the same with the engine kept from a warm-up run (*_kept, *_kept_spec: the graphs
# captured before the timed run, as in a training run's later steps).
# Records: $OUT/bench_<batch>.json, the console in $OUT/bench.log, tests in $OUT/tests.log.
# Usage: OUT=... [BATCHES="16 64"] [DRAFT_TOKENS=4] bash scripts/gpu/speculative.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_speculative}
export RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-"test_engine test_retool bench_rollout grpo_train"}
source scripts/gpu/build.sh
rc=0
{
  build-gpu/bin/test_engine --gtest_filter='*Retract*:*StepDraw*:*VerifyDraw*' || rc=1
  build-gpu/bin/test_retool --gtest_filter='*Specul*:*Draft*' || rc=1
} > "$out/tests.log" 2>&1
grep -E "PASSED|FAILED|SKIPPED|Failure" "$out/tests.log"
if grep -q "SKIPPED" "$out/tests.log"; then
  echo "speculative.sh: a CUDA test skipped on a GPU host"
  rc=1
fi
model=configs/models/qwen2.5-0.5b
for b in ${BATCHES:-16 64}; do
  build-gpu/bin/bench_rollout --model $model --tokenizer "$RLT_FIXTURES_DIR/tokenizers/qwen3" --device cuda \
    --dtype bfloat16 --batch "$b" --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
    --modes tools,plain_spec,tools_spec,tools_kept,plain_kept_spec,tools_kept_spec --draft-tokens "${DRAFT_TOKENS:-4}" \
    --json "$out/bench_${b}.json" 2>&1 | tee -a "$out/bench.log" || rc=1
done
exit $rc
