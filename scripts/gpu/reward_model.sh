#!/usr/bin/env bash
# A reward model's cost in a whole step on one GPU: configs/retool.yaml at the e2e shape (scripts/gpu/e2e_peer.sh,
# TRL off) with reward.kind model, scored by a random Qwen2.5-0.5B-shaped Qwen2ForSequenceClassification saved
# by transformers in bf16 with the published Qwen tokenizer and chat template. metrics.jsonl's time_reward_s
# against time_rollout_s is the figure; raw/metrics_ours_sync.jsonl keeps them.
# Usage: OUT=... bash scripts/gpu/reward_model.sh; REWARD_SET="--set k=v ..." adds settings to the run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-runs/gpu_reward_model}
mkdir -p "$out"
export RLT_FIXTURES_DIR=${RLT_FIXTURES_DIR:-$PWD/.gpu/fixtures}
rm_dir=/tmp/qwen2.5-0.5b-reward-model
python3 - configs/models/qwen2.5-0.5b "$rm_dir" <<'PY' || exit 1
import sys, torch
from transformers import AutoConfig, AutoModelForSequenceClassification
cfg = AutoConfig.from_pretrained(sys.argv[1], num_labels=1, architectures=["Qwen2ForSequenceClassification"])
cfg.pad_token_id = 151643
torch.manual_seed(1)
AutoModelForSequenceClassification.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[2])
PY
cp "$RLT_FIXTURES_DIR/tokenizers/qwen3/tokenizer.json" "$RLT_FIXTURES_DIR/tokenizers/qwen3/tokenizer_config.json" "$rm_dir/"
TRL=0 OURS_SET="--set reward.kind=model --set reward.model_path=$rm_dir ${REWARD_SET:-}" OUT="$out" bash scripts/gpu/e2e_peer.sh
tar xzf "$out/raw.tgz" -C "$out" raw/metrics_ours_sync.jsonl || exit 1  # e2e_peer.sh packs raw/ at its end
python3 - "$out/raw/metrics_ours_sync.jsonl" <<'PY' | tee "$out/reward_model.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]  # the steps after the first
for k in ("time_reward_s", "time_rollout_s", "time_step_s", "reward_terms/model"):
    v = [r[k] for r in rows if k in r]
    print(k, sum(v) / max(1, len(v)))
PY
