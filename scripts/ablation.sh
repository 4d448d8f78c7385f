#!/usr/bin/env bash
# The loss-module ablation on the built-in demo: one GRPO step from the same policy (the demo's final
# checkpoint), the same rollout, under every loss.impl and row-selection setting. Prints a markdown table
# of the step's loss, mean log-prob of the sampled tokens, gradient norm and the update's peak extra
# memory, from each run's metrics.jsonl.
# Usage: bash scripts/ablation.sh [RUN_DIR (default runs/retool_tiny)] [extra --set args...]
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:-runs/retool_tiny}
shift || true
extra=("$@")
[ -f "$run/checkpoint/model/config.json" ] || { echo "ablation: $run holds no checkpoint; run the demo first" >&2; exit 2; }
out=runs/ablation
mkdir -p "$out"
variants=("naive false false" "naive true false" "naive true true" "selective false false" "selective true false"
          "selective true true" "cce false false" "cce true false" "cce true true")
for v in "${variants[@]}"; do
  set -- $v
  name="$1_ro$2_lm$3"
  build/bin/grpo_train --config configs/retool_tiny.yaml --out "$out/$name" --set model.path="$run/checkpoint/model" \
    --set model.tokenizer="$run/tokenizer.model" --set sft.steps=0 --set train.steps=1 --set train.eval_prompts=0 \
    --set train.checkpoint_every=0 --set train.num_iterations=2 --set train.mini_batch_size=64 \
    --set loss.impl="$1" --set loss.response_only="$2" --set loss.loss_mask_only="$3" ${extra[@]+"${extra[@]}"} > "$out/$name.log" 2>&1
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
print("| loss.impl | response_only | loss_mask_only | loss | logprob_mean | grad_norm | update peak MiB |")
print("|---|---|---|---|---|---|---|")
for d in sorted(os.listdir(out)):
    f = os.path.join(out, d, "metrics.jsonl")
    if not os.path.exists(f):
        continue
    m = json.loads(open(f).readline())
    impl, ro, lm = d.split("_")
    print(f"| {impl} | {ro[2:]} | {lm[2:]} | {m['loss']:.9f} | {m['logprob_mean']:.9f} | {m['grad_norm']:.7f} | "
          f"{m['peak_memory_update_mib']:.1f} |")
PY
