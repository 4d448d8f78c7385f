#!/usr/bin/env python3
"""Our LoRA adapter folders through transformers + peft: each must load onto its base checkpoint with
PeftModel.from_pretrained and give the logits our decoder gave (fp32, CPU, with the attention
implementation our decoder runs).

Usage: check_peft.py ATOL BASE_DIR ADAPTER_DIR OURS.safetensors [BASE_DIR ADAPTER_DIR OURS ...]

OURS.safetensors holds "ids" (B, L) int64 and "logits" (B, L, V) float32 from test_lora. The twin: the
same folder with lora_alpha doubled (every update scaled twice) must miss by more than ATOL, so the
bound tells a right adapter from a wrong scale. Exits 1 on any failure, naming the case.
"""

import json
import os
import shutil
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def peft_logits(base_dir, adapter_dir, ids):
    # The attention our decoder runs: SDPA, except gemma2's soft-capped scores in the eager form. The
    # logits then agree to the last bit on the CPU (observed), well inside ATOL.
    with open(os.path.join(base_dir, "config.json")) as f:
        eager = json.load(f)["model_type"] == "gemma2"
    model = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa")
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def main():
    atol = float(sys.argv[1])
    args = sys.argv[2:]
    if len(args) == 0 or len(args) % 3 != 0:
        sys.exit("usage: check_peft.py ATOL (BASE_DIR ADAPTER_DIR OURS.safetensors)...")
    failed = []
    for base_dir, adapter_dir, ours_file in zip(args[0::3], args[1::3], args[2::3]):
        ours = load_file(ours_file)
        ids, want = ours["ids"], ours["logits"]
        got = peft_logits(base_dir, adapter_dir, ids)
        diff = (got - want).abs().max().item()
        with tempfile.TemporaryDirectory() as tmp:
            twin_dir = os.path.join(tmp, "adapter")
            shutil.copytree(adapter_dir, twin_dir)
            cfg_path = os.path.join(twin_dir, "adapter_config.json")
            with open(cfg_path) as f:
                cfg = json.load(f)
            cfg["lora_alpha"] = 2 * cfg["lora_alpha"]
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            twin_diff = (peft_logits(base_dir, twin_dir, ids) - want).abs().max().item()
        ok = diff <= atol and twin_diff > atol
        print(f"{os.path.basename(base_dir)}: max |peft - ours| {diff:.3g}, twin (lora_alpha x2) {twin_diff:.3g}"
              f"{'' if ok else '  FAIL'}")
        if not ok:
            failed.append(base_dir)
    if failed:
        print("failed:", failed)
        sys.exit(1)


if __name__ == "__main__":
    main()
