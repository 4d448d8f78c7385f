#!/usr/bin/env python3
"""cuBLAS's time for the GEMMs a CCE forward+backward is made of, on this GPU (PyTorch, bf16 operands).

For an LM head (N rows, V vocabulary, D hidden) and a backward block of `rows` x `vb` vocabulary entries:
  logits    z = h W^T            (N, V), the forward's and the backward's recomputed GEMM
  dE block  dE += dz W_blk       (N, vb) x (vb, D), fp32 output accumulated (beta = 1)
  dW block  dW_blk = dz^T h      (vb, N) x (N, D), bf16 output
Each is timed with CUDA events (median of --reps after 3 warm-ups) and reported in ms and TFLOP/s; the
block GEMMs are also given times the number of blocks, so the four add up to the ceiling of a
recompute-based CCE fw+bw built on cuBLAS (the block count is V / block, fractional: a last partial
block counts for its share of a full one's time). Usage:
  python3 scripts/dev/gemm_ceiling.py [--shape seed002|qwen|llama]... [--block 4096] [--json out.json]
"""
import argparse
import json

import torch

SHAPES = {"seed002": (8192, 256000, 2304), "qwen": (8192, 151936, 896), "llama": (8192, 128256, 4096)}


def timed(fn, reps):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--block", type=int, default=4096, help="vocabulary entries per backward block")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    records = []
    print(f"{'shape':8} {'gemm':10} {'m':>7} {'n':>7} {'k':>7} {'ms':>9} {'TFLOP/s':>8} {'blocks':>6} {'total ms':>9}")
    for name in args.shape or ["seed002", "qwen", "llama"]:
        N, V, D = SHAPES[name]
        vb = min(args.block, V)
        blocks = V / vb
        h = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(V, D, device=dev, dtype=torch.bfloat16, generator=g)
        dz = torch.randn(N, vb, device=dev, dtype=torch.bfloat16, generator=g)
        wb = w[:vb]
        z = torch.empty(N, V, device=dev, dtype=torch.bfloat16)
        dE = torch.zeros(N, D, device=dev, dtype=torch.float32)
        dWb = torch.empty(vb, D, device=dev, dtype=torch.bfloat16)

        def dE_step():
            torch.addmm(dE, dz, wb, out_dtype=torch.float32, out=dE)

        cases = [
            ("logits", N, V, D, lambda: torch.mm(h, w.t(), out=z), 1),
            ("dE_block", N, D, vb, dE_step, blocks),
            ("dW_block", vb, D, N, lambda: torch.mm(dz.t(), h, out=dWb), blocks),
        ]
        for gemm, m, n, k, fn, count in cases:
            ms = timed(fn, args.reps)
            tflops = 2.0 * m * n * k / ms / 1e9
            rec = dict(shape=name, gemm=gemm, m=m, n=n, k=k, ms=ms, tflops=tflops, blocks=count, total_ms=ms * count)
            records.append(rec)
            print(f"{name:8} {gemm:10} {m:7} {n:7} {k:7} {ms:9.3f} {tflops:8.1f} {count:6.1f} {ms * count:9.2f}")
        total = sum(r["total_ms"] for r in records if r["shape"] == name)
        logits = next(r["ms"] for r in records if r["shape"] == name and r["gemm"] == "logits")
        print(f"{name:8} fw+bw ceiling (logits twice + dE + dW blocks): {total + logits:.2f} ms")
        del h, w, dz, z, dE, dWb
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
