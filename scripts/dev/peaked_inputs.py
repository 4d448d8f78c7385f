#!/usr/bin/env python3
"""How sparse is a peaked softmax at the tile level? (gradient filtering on peaked inputs)

Builds CCE inputs E (N, D) and C (V, D) whose logits E C^T look like a trained LM head's, as the CCE
paper's Fig. 3 describes them (sorted probabilities linear in log-rank, below 2^-12 by about the 50th
token), then reports what a gradient filter at threshold 2^-12 could skip: the fraction of entries
above it, and the fraction of (rows x vocab) tiles and of vocab blocks that hold one.

Construction (float64):
- C: N(0, 1/(D-1)) entries, except column 0 = -b ln(1 + v): a frequency prior, ids in frequency order.
- Each row n gets K token ids t_1..t_K drawn without replacement from Zipf(s) over the ids, and exact
  logits A - b ln k on them: E_n = (1, e_n), e_n the minimum-norm solution of C[t_k, 1:] e_n =
  A - b ln k - C[t_k, 0] - (A - tail); every other token's logit is its prior plus noise e_n . C_v.

Usage: python3 scripts/dev/peaked_inputs.py [--rows 256] [--vocab 256000] [--hidden 2304] [--k 64]
"""
import argparse
import math

import torch


def build(N, V, D, K=64, top=30.0, slope=1.5, zipf=1.0, tail=4.0, seed=0, device="cpu", chunk=1024):
    """E (N, D), C (V, D) in float64 on `device` and each row's K token ids (N, K), as the docstring says.
    bench_loss --case peaked (make_peaked) builds the same, with the rows' ids drawn by Gumbel top-k."""
    g = torch.Generator(device=device).manual_seed(seed)
    f64 = dict(dtype=torch.float64, device=device)
    C = torch.randn(V, D, generator=g, **f64) / math.sqrt(D - 1)
    ids = torch.arange(V, **f64)
    C[:, 0] = -slope * torch.log1p(ids)
    w = ((ids + 1) ** (-zipf)).float()
    beta = top - slope * torch.log(torch.arange(1, K + 1, **f64))
    E = torch.empty(N, D, **f64)
    tok = torch.empty(N, K, dtype=torch.long, device=device)
    for r0 in range(0, N, chunk):
        n = min(chunk, N - r0)
        t = torch.multinomial(w.expand(n, V), K, replacement=False, generator=g)  # (n, K)
        Ct = C[t]  # (n, K, D)
        rhs = beta.view(1, K) - Ct[:, :, 0] - (top - tail)
        M = Ct[:, :, 1:]
        e = M.transpose(1, 2) @ torch.linalg.solve(M @ M.transpose(1, 2), rhs.unsqueeze(2))
        E[r0:r0 + n, 0] = 1.0
        E[r0:r0 + n, 1:] = e.squeeze(2)
        tok[r0:r0 + n] = t
    return E, C, tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256000)
    ap.add_argument("--hidden", type=int, default=2304)
    ap.add_argument("--k", type=int, default=64, help="row-specific tokens with power-law logits")
    ap.add_argument("--top", type=float, default=30.0, help="logit of each row's first token (A)")
    ap.add_argument("--slope", type=float, default=1.5, help="b: log-prob slope over log-rank")
    ap.add_argument("--zipf", type=float, default=1.0, help="s: the row tokens' Zipf exponent over ids")
    ap.add_argument("--tail", type=float, default=4.0, help="the prior's level below A, in nats")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    N, V, D, K = a.rows, a.vocab, a.hidden, a.k
    E, C, tok = build(N, V, D, K, a.top, a.slope, a.zipf, a.tail, a.seed)
    p = torch.softmax(E @ C.T, 1)
    thr = 2.0 ** -12
    above = p >= thr
    srt = torch.sort(p, 1, descending=True).values
    per_row = above.sum(1).double()
    print(f"rows {N}, vocab {V}, hidden {D}, K {K}, A {a.top}, b {a.slope}, zipf {a.zipf}, tail {a.tail}")
    print(f"entries >= 2^-12: {per_row.mean():.1f} per row (min {int(per_row.min())}, max {int(per_row.max())}), "
          f"fraction {above.double().mean():.2e}")
    for r in [1, 2, 10, 50, 64, 100, 1000, 10000, 100000]:
        if r <= V:
            print(f"  rank {r:6d}: median log10 p {srt[:, r - 1].log10().median():7.2f}")
    print(f"p of the first row token (a target): mean {p.gather(1, tok[:, :1]).mean():.3f}")
    for tr, tc in [(128, 256), (128, 128)]:
        if N >= tr:
            t = above[: N // tr * tr, : V // tc * tc].reshape(N // tr, tr, V // tc, tc).any(3).any(1)
            print(f"tiles {tr} x {tc} holding an entry >= 2^-12: {t.double().mean():.3f}")
    b = above[:, : V // 4096 * 4096].reshape(N, V // 4096, 4096).any(2).any(0)
    print(f"vocab blocks of 4096 holding one among the {N} rows: {b.double().mean():.3f}")


if __name__ == "__main__":
    main()
