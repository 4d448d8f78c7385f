#!/usr/bin/env python3
"""transformers' own rollout/training log-prob mismatch: the peer figure beside ours.

The same weights score the same sampled tokens twice:
  - generate: sampled with the KV cache (do_sample, temperature 1, no top-k/top-p), its raw logits kept
    (output_logits) and turned into log-probs of the sampled tokens;
  - forward: one pass over prompt + completion, as a trainer recomputes the old policy's log-probs.
Prints and writes {"mismatch_mean", "mismatch_max", ...} over every sampled token. Our figure is
logprob_mismatch_mean / _max in metrics.jsonl (rollout log-probs vs the trainer's, same weights).

  python3 scripts/dev/hf_logprob_mismatch.py --model configs/models/qwen2.5-0.5b --batch 64 \
      --prompt-len 256 --new-tokens 512 --json out.json
--model is a folder with config.json: random weights (torch.manual_seed(0), as scripts/gpu/train.sh saves
its checkpoint) unless it holds safetensors.
"""
import argparse
import glob
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("hf_logprob_mismatch: needs a CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(a.seed)
    if glob.glob(os.path.join(a.model, "*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model), dtype=dtype)
    model = model.cuda().eval()
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(a.seed + 1)
    prompts = torch.randint(0, vocab, (a.batch, a.prompt_len), generator=g).cuda()
    with torch.no_grad():
        t0 = time.time()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                             eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        torch.cuda.synchronize()
        gen_s = time.time() - t0
        seq = out.sequences                                        # (B, P + N)
        completion = seq[:, a.prompt_len:]                         # (B, N)
        gen_logits = torch.stack(out.logits, dim=1).float()        # (B, N, V): raw, before sampling
        lp_gen = torch.log_softmax(gen_logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        del gen_logits
        fwd_logits = model(seq).logits[:, a.prompt_len - 1:-1].float()  # the rows that predict the completion
        lp_fwd = torch.log_softmax(fwd_logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    diff = (lp_gen - lp_fwd).abs()
    result = {
        "model": a.model, "dtype": a.dtype, "batch": a.batch, "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens, "tokens": int(diff.numel()),
        "mismatch_mean": diff.mean().item(), "mismatch_max": diff.max().item(),
        "logprob_mean": lp_fwd.mean().item(), "generate_s": gen_s,
        "transformers": __import__("transformers").__version__, "torch": torch.__version__,
    }
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
