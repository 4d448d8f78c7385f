#!/usr/bin/env python3
"""transformers peer of build/bin/bench_model: prefill and decode tokens/s of a decoder.

Usage: python3 scripts/bench_model_peers.py --model DIR [--device cuda|cpu]
           [--dtype bfloat16|float32] [--batch B] [--prompt-len P] [--new-tokens N]
           [--reps R] [--json FILE] [--layers K]

DIR holds a Hugging Face config.json; without safetensors in it the model is built from the
config with random weights (seed 0), as bench_model does, so both sides run the same shape.

Measurement rules (shared with apps/bench_model.cpp; MiB = 2**20 bytes):
  seconds         wall time, time.perf_counter() between torch.cuda.synchronize() calls (the
                  C++ side uses steady_clock around device_synchronize). Median of --reps.
  prefill         model(ids (B, P), use_cache=True, logits_to_keep=1): the forward generate()
                  itself runs first (it passes logits_to_keep=1), so it is what gets subtracted.
  decode_*        generate(max_new_tokens=min_new_tokens=N); decode seconds = generate seconds -
                  median prefill seconds, tokens_per_s = B*N / that. The raw generate numbers
                  are extra fields "generate_seconds" / "generate_tokens_per_s".
  peak_extra_mb   max_memory_allocated() during the call minus memory_allocated() just before it
                  (weights and prompt ids already allocated, peak stats reset); cuda only.
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

MIB = 2**20
KEYS = ("impl", "mode", "batch", "prompt_len", "new_tokens", "dtype", "tokens_per_s", "seconds",
        "peak_extra_mb", "note")


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def load_model(args, dev):
    dtype = getattr(torch, args.dtype)
    has_weights = any(os.path.exists(os.path.join(args.model, f)) for f in
                      ("model.safetensors", "model.safetensors.index.json"))
    cfg = AutoConfig.from_pretrained(args.model)
    if args.layers is not None:  # smoke tests only: fewer layers, same per-layer shape
        cfg.num_hidden_layers = args.layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = cfg.layer_types[:args.layers]
    if has_weights:
        model = AutoModelForCausalLM.from_pretrained(args.model, config=cfg, dtype=dtype,
                                                     attn_implementation="sdpa")
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.to(dev).eval(), cfg, has_weights


def prompt(vocab, B, P, dev, seed):
    # A seed per rep (100 + i, like bench_model) so reps see different but reproducible prompts.
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randint(0, vocab, (B, P), generator=g, device=dev)


def timed(fn, dev):
    """Runs fn() once; returns (seconds, peak_extra_mb or None)."""
    sync(dev)
    base = None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    secs = time.perf_counter() - t0
    peak = None if base is None else (torch.cuda.max_memory_allocated(dev) - base) / MIB
    del out  # freed only after the peak was read, so the output counts as extra
    return secs, peak


def prefill_fn(model, ids):
    # logits_to_keep=1: generate()'s own prefill computes only the last position's logits; full
    # (B, P, V) logits would be a different (and at V=151936 much heavier) forward.
    return lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)


def generate_fn(model, ids, N, sample):
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else \
        dict(do_sample=False)
    # eos_token_id=None and min_new_tokens=N: every sequence runs exactly N steps; with no eos
    # generate adds no min-length processor. The mask is all ones (no padding), as in bench_model.
    return lambda: model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
                                  eos_token_id=None, **kw)


def measure(make_fn, model, vocab, B, P, dev, reps):
    """Median seconds and the largest peak over reps; (None, None, 'OOM: ...') on CUDA OOM."""
    msg = None
    try:
        runs = []
        for i in range(reps):
            ids = prompt(vocab, B, P, dev, 100 + i)
            runs.append(timed(make_fn(ids), dev))
            del ids
        peaks = [p for _, p in runs if p is not None]
        return statistics.median(s for s, _ in runs), (max(peaks) if peaks else None), ""
    except torch.OutOfMemoryError as e:
        msg = "OOM: " + (str(e).strip().splitlines() or ["?"])[0]
    # Outside the except block, so the traceback's frames (and their tensors) are gone.
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return None, None, msg


def fmt(x, spec):
    return format("-", ">" + spec.split(".")[0]) if x is None else format(x, spec)


HEADER = (f"{'impl':22} {'mode':14} {'batch':>5} {'prompt':>6} {'new':>5} {'tokens/s':>12} "
          f"{'seconds':>9} {'peak_MiB':>9} {'gen_tok/s':>11} {'gen_s':>8}  note")


def print_row(r):
    print(f"{r['impl']:22} {r['mode']:14} {r['batch']:>5} {r['prompt_len']:>6} "
          f"{r['new_tokens']:>5} {fmt(r['tokens_per_s'], '12.1f')} {fmt(r['seconds'], '9.4f')} "
          f"{fmt(r['peak_extra_mb'], '9.1f')} {fmt(r.get('generate_tokens_per_s'), '11.1f')} "
          f"{fmt(r.get('generate_seconds'), '8.4f')}  {r['note'][:90]}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="folder with config.json (+ optional weights)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    ap.add_argument("--json", help="write the records here as a JSON list")
    ap.add_argument("--layers", type=int, help="override num_hidden_layers (smoke tests)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available (use --device cpu)")
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    B, P, N = args.batch, args.prompt_len, args.new_tokens
    torch.set_grad_enabled(False)  # process-wide: generate() and the prefill build no graphs

    model, cfg, has_weights = load_model(args, dev)
    vocab = cfg.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__} on {args.device}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(f"model {args.model}: {cfg.model_type}, {cfg.num_hidden_layers} layers, "
          f"{n_params / 1e6:.2f}M parameters, {args.dtype}, "
          f"{'loaded weights' if has_weights else 'random init (seed 0)'}")

    # Warm-up at the measured batch and prompt size with 8 new tokens, as bench_model does: CUDA
    # context, cuBLAS handles, SDPA kernel selection, allocator growth and generate()'s first-call
    # setup stay out of the timed reps.
    for fn in (prefill_fn(model, prompt(vocab, B, P, dev, 1)),
               generate_fn(model, prompt(vocab, B, P, dev, 1), min(N, 8), False),
               generate_fn(model, prompt(vocab, B, P, dev, 1), min(N, 8), True)):
        timed(fn, dev)

    records = []
    base = dict(batch=B, prompt_len=P, new_tokens=N, dtype=args.dtype)

    def add(rec):
        rec = dict({k: rec.pop(k, None) for k in KEYS}, **rec)  # schema order, then extras
        records.append(rec)
        print_row(rec)

    print(HEADER, flush=True)
    pre_s, pre_peak, msg = measure(lambda ids: prefill_fn(model, ids), model, vocab, B, P, dev,
                                   args.reps)
    add(dict(base, impl="transformers_prefill", mode="prefill", seconds=pre_s,
             tokens_per_s=None if pre_s is None else B * P / pre_s, peak_extra_mb=pre_peak,
             note=msg or "logits_to_keep=1 (as generate's prefill)"))

    for sample in (False, True):
        gen_s, gen_peak, msg = measure(lambda ids: generate_fn(model, ids, N, sample), model,
                                       vocab, B, P, dev, args.reps)
        rec = dict(base, impl="transformers_generate",
                   mode="decode_sample" if sample else "decode_greedy", peak_extra_mb=gen_peak,
                   generate_seconds=gen_s,
                   generate_tokens_per_s=None if gen_s is None else B * N / gen_s,
                   prefill_seconds_subtracted=pre_s,
                   note=msg or "seconds = generate - median prefill; peak covers prefill + decode")
        if gen_s is not None and pre_s is not None and gen_s > pre_s:
            rec["seconds"] = gen_s - pre_s
            rec["tokens_per_s"] = B * N / rec["seconds"]
        elif not msg:
            rec["note"] = "no decode time: prefill missing or >= generate time"
        add(rec)

    if args.json:
        parent = os.path.dirname(args.json)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
