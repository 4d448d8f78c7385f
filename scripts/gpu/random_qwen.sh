# Sourced by scripts/gpu/train.sh, dist.sh and shard.sh on the GPU host, with $out set: a random
# Qwen2.5-shaped checkpoint saved by transformers in $ckpt (bf16, with the published Qwen tokenizer
# files, as a real Qwen folder has them; Qwen2.5 and Qwen3 share the base vocabulary), and a small math
# JSONL in $out/math.jsonl. The 0.5B shape by default; RANDOM_QWEN=7b makes the 7B one, its weights drawn
# on the GPU (on the host's cores a 7.6B-parameter draw takes minutes). A checkpoint already in $ckpt,
# left by an earlier command on the same host (the scripts keep it with RANDOM_QWEN_KEEP=1), is reused: the
# 32B one is 65 GB, a minute and a half to draw and write.
size=${RANDOM_QWEN:-0.5b}
model=configs/models/qwen2.5-$size
ckpt=/tmp/qwen2.5-$size-random
init_device=cpu
[ "$size" = 0.5b ] || init_device=cuda
reuse=0
[ -f "$ckpt/tokenizer_config.json" ] && reuse=1
python3 - "$model" "$ckpt" "$out/math.jsonl" "$init_device" "$reuse" <<'PY'
import json, random, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
if sys.argv[5] == "0":
    with torch.device(sys.argv[4]):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(sys.argv[2])
    del model
rng = random.Random(0)
with open(sys.argv[3], "w") as f:
    for _ in range(512):
        a, b = rng.randint(100, 9999), rng.randint(100, 9999)
        f.write(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n")
PY
cp "$RLT_FIXTURES_DIR/tokenizers/qwen3/tokenizer.json" "$RLT_FIXTURES_DIR/tokenizers/qwen3/tokenizer_config.json" "$ckpt/"
