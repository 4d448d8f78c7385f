#!/usr/bin/env python3
"""transformers peer of build/bin/bench_update: one GRPO policy update (forward, per-token log-probs of
the response, clipped-surrogate loss on loss-mask tokens, backward) of B sequences of L tokens.

Usage: python3 scripts/bench_update_peer.py --model DIR [--device cuda] [--dtype bfloat16]
           [--batch 8] [--seq-len 4096] [--prompt-len 256] [--tool-fraction 0.2] [--reps 3] [--json FILE]

The batch is built as bench_update builds it (same seed, prompt length and tool-output spans); the
weights are random (the two sides' initialisations differ, so log-prob means are not compared across
implementations). Settings:
  hf_full_logsoftmax        logits (B, L, V) -> float -> log_softmax -> gather: the textbook path
  hf_row_loop               the row-looped selective log-softmax of seed 000 (one sequence's logits at
                            a time in float32), the fastest pure-PyTorch path for bf16 logits
each with gradient checkpointing on (the transformers switch) unless the name ends in _no_ckpt.
Peak extra memory: max_memory_allocated() during the update minus memory_allocated() before it, with
the weights' gradient buffers already allocated by a warm-up update (as bench_update measures).
"""
import argparse
import json
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

MIB = 2**20


def make_batch(B, L, P, tool_fraction, vocab):
    torch.manual_seed(7)
    ids = torch.randint(0, vocab, (B, L))
    span = 64
    period = max(span + 1, int(span / tool_fraction)) if tool_fraction > 0 else 0
    mask = torch.zeros(B, L)  # mask[b, t] = 1: token t is a sampled response token
    for j in range(L - P):
        tool = period > 0 and (j % period) >= period - span
        mask[:, P + j] = 0.0 if tool else 1.0
    return ids, mask


def logprobs_full(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def logprobs_row_loop(logits, targets):
    rows = []
    for lg, tg in zip(logits, targets):  # one sequence's (L, V) at a time
        rows.append(torch.log_softmax(lg.float(), dim=-1).gather(-1, tg.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def update(model, ids, mask, adv, logprob_fn):
    logits = model(input_ids=ids).logits[:, :-1]  # (B, L-1, V): row t scores ids[t+1]
    lp = logprob_fn(logits, ids[:, 1:])           # (B, L-1) float32
    m = mask[:, 1:]
    ratio = torch.exp(lp - lp.detach())
    a = adv[:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - 0.2, 1 + 0.28))
    per_seq = (pg * m).sum(1) / m.sum(1).clamp_min(1)  # seq-mean-token-mean
    loss = per_seq.sum() / (m.sum(1) > 0).sum().clamp_min(1)
    loss.backward()
    return (lp.detach() * m).sum() / m.sum()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tool-fraction", type=float, default=0.2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = AutoConfig.from_pretrained(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").to(dev)
    model.train()
    ids, mask = make_batch(args.batch, args.seq_len, args.prompt_len, args.tool_fraction, cfg.vocab_size)
    ids, mask = ids.to(dev), mask.to(dev)
    torch.manual_seed(11)
    adv = torch.randn(args.batch).to(dev)
    print(f"bench_update_peer: transformers {cfg.model_type}, B={args.batch} L={args.seq_len} "
          f"P={args.prompt_len}, {args.dtype} on {args.device}")
    print(f"{'setting':28} {'ms':>12} {'peak_MiB':>14} {'logprob_mean':>18}")
    records = []
    for name, fn, ckpt in [("hf_full_logsoftmax", logprobs_full, True), ("hf_row_loop", logprobs_row_loop, True),
                           ("hf_row_loop_no_ckpt", logprobs_row_loop, False)]:
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        runs = []
        try:
            for i in range(args.reps + 1):  # the first is the warm-up: gradient buffers, kernels
                model.zero_grad(set_to_none=False)
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
                t0 = time.perf_counter()
                lpm = update(model, ids, mask, adv, fn)
                torch.cuda.synchronize(dev)
                ms = (time.perf_counter() - t0) * 1000
                peak = (torch.cuda.max_memory_allocated(dev) - base) / MIB
                if i > 0:
                    runs.append((ms, peak, lpm.item()))
        except torch.OutOfMemoryError as e:
            print(f"{name:28} out of memory: {str(e).splitlines()[0][:100]}", flush=True)
            records.append({"impl": "transformers", "setting": name, "oom": True})
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            continue
        ms = statistics.median(r[0] for r in runs)
        peak = statistics.median(r[1] for r in runs)
        print(f"{name:28} {ms:12.1f} {peak:14.1f} {runs[0][2]:18.7f}", flush=True)
        records.append({"impl": "transformers", "setting": name, "activation_checkpointing": ckpt,
                        "batch": args.batch, "seq_len": args.seq_len, "prompt_len": args.prompt_len,
                        "tool_fraction": args.tool_fraction, "dtype": args.dtype, "ms": ms,
                        "tokens_per_s": args.batch * args.seq_len / (ms / 1000), "peak_extra_mib": peak,
                        "logprob_mean": runs[0][2]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
