# Sourced by scripts/gpu/train.sh and scripts/gpu/dist.sh on the GPU host, with $out set: a random
# Qwen2.5-0.5B-shaped checkpoint saved by transformers in $ckpt (bf16, with the published Qwen tokenizer
# files, as a real Qwen folder has them; Qwen2.5 and Qwen3 share the base vocabulary), and a small math
# JSONL in $out/math.jsonl.
model=configs/models/qwen2.5-0.5b
ckpt=/tmp/qwen2.5-0.5b-random
python3 - "$model" "$ckpt" "$out/math.jsonl" <<'PY'
import json, random, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[2])
rng = random.Random(0)
with open(sys.argv[3], "w") as f:
    for _ in range(512):
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        f.write(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n")
PY
cp "$RLT_FIXTURES_DIR/tokenizers/qwen3/tokenizer.json" "$RLT_FIXTURES_DIR/tokenizers/qwen3/tokenizer_config.json" "$ckpt/"
