set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
(cd build-gpu && ctest -R 'ModelPolicy|StepSpans|KeepCache|ReservedRows|AdmitInto|Compaction|ReTool|Sampler' --output-on-failure) > "$out/ctest_policy.log" 2>&1; grep -E 'tests passed|Failed|Skipped' "$out/ctest_policy.log" | head
model=configs/models/qwen2.5-0.5b
for r in 1 2; do
  for w in 4 8; do
    build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
      --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 --feed-wait $w \
      --modes tools_eager,tools_kept,spread_kept --json "$out/loop_w${w}_$r.json" 2>&1 | tee -a "$out/loop.log"
  done
done
python3 - "$out" <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "loop_w*.json"))):
    for r in json.load(open(f)):
        print(os.path.basename(f), r["mode"], "ratio %.3f" % r["ratio_to_plain"], "s %.3f" % r["seconds"], "decode %.3f" % r["decode_s"],
              "feed %.3f" % r["feed_s"], "sample %.3f" % r["sample_s"], "steps", r["decode_steps"], "feeds", r["feed_steps"])
PY
