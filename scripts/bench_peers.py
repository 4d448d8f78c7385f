#!/usr/bin/env python3
"""PyTorch peers of the log-prob memory/speed benchmark.

The C++ half (build/bin/bench_loss) measures this project's loss paths and writes the
same JSON record schema; this script measures what a PyTorch user would write instead,
in the three settings of the seed documents:

  seed000  selective log-softmax blog: (B*T, V) logits, B=16, T=1024, V=32768, fp32 and bf16
  seed001  response-row gathering PR: full (T, V) fp32 logits, T=205280, V=76032, log-prob +
           entropy on the response rows only, for several response fractions
  seed002  Cut Cross-Entropy Table 1: E (N, D) and C (V, D) bf16, N=8192, V=256000, D=2304
  heads    the LM heads of real models, N=8192, bf16, log-prob + entropy: Qwen2.5-0.5B (D=896,
           V=151936) and Llama-3-8B (D=4096, V=128256); inputs built as seed002's
  peaked   seed002's shape, a trained-model-like softmax (scripts/dev/peaked_inputs.py); not in all

Fused peers (when installed: pip install cut-cross-entropy liger-kernel; the GPU host takes their wheels
from .gpu/wheels): apple CCE (linear_cross_entropy, impl="cce") and Liger's fused linear cross-entropy,
both in the RL form: reduction "none" (one log-prob per token), backward with a per-token upstream
gradient (ones: d(sum of log-probs), what bench_loss backpropagates). Neither returns an entropy. apple
CCE runs with its default gradient filtering (filter_eps "high"), as this project's cce runs with its own
(loss.grad_filter); Liger's reduction="none" backward is exact for this uniform upstream gradient.

Usage: python3 scripts/bench_peers.py --case seed000|seed001|seed002|heads|all
           [--scale F] [--json FILE] [--device cuda|cpu] [--reps N]

Measurement rules (shared with the C++ side; MiB = 2**20 bytes):
  peak_extra_mb   max_memory_allocated() during the call minus memory_allocated() just before
                  it (inputs already allocated, peak stats reset). fwbw = forward + backward;
                  the returned gradients count as extra.
  ms              median of --reps CUDA-event-timed calls after the warm-ups.
  max_abs_err     max |logprob - float64 reference| (forward value, also for fwbw records).
  lower_bound_mb  fw: the output (rows * 4 bytes); fwbw: the gradients the call must return.
Extra record fields: seed000 "batch", "seq" (take2 loops over the batch); seed001
"response_frac", "response_rows" ("rows" is T, the rows of the (T, V) input logits).
"""
import argparse
import gc
import json
import math
import statistics
import time

import warnings

import torch
import torch.nn.functional as F

# Inductor says this for every softmax it splits; it is expected at these vocab sizes.
warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled")

MIB = 2**20

# --- seed002 input definition: part of the benchmark, the C++ side builds the same tensors ---
# C = randn(V, D) / sqrt(D) has unit-norm rows; E = ALPHA * C[targets] + SIGMA * randn(N, D).
# Target logit ~ ALPHA (+- N(0, SIGMA^2)), the other logits ~ N(0, SIGMA^2 + ALPHA^2 / D), so
# p(target) ~ e^ALPHA / (e^ALPHA + V e^(s^2/2)). Measured on CPU at the full V=256000, D=2304
# (N=256, bf16 inputs, float64 logits): ALPHA=12 -> mean p 0.31, ALPHA=13 -> 0.51, ALPHA=14 ->
# 0.70. A peaked softmax like a trained LM head, unlike randn logits (p ~ 1/V everywhere).
S2_N, S2_V, S2_D = 8192, 256000, 2304
S2_ALPHA = 13.0
S2_SIGMA = 1.0
S2_SEED = 0

OOM_ERRORS = (torch.OutOfMemoryError,)


def scaled(n, scale):
    # Round half up (not Python's banker's rounding) so C++'s std::lround gives the same rows.
    return max(1, int(math.floor(n * scale + 0.5)))


def seed002_inputs(n, v, d, device):
    g = torch.Generator(device=device).manual_seed(S2_SEED)
    C = torch.randn(v, d, generator=g, device=device, dtype=torch.float32) / math.sqrt(d)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    E = S2_ALPHA * C[targets] + S2_SIGMA * torch.randn(n, d, generator=g, device=device,
                                                       dtype=torch.float32)
    return E.to(torch.bfloat16), C.to(torch.bfloat16), targets


# --- the peers ---

def naive(logits, index):
    logprobs = logits.log_softmax(dim=-1)
    return torch.gather(logprobs, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


def take2(logits, index):
    """Seed 000's final selective_log_softmax, verbatim (loops over the first dim)."""
    if logits.dtype in [torch.float32, torch.float64]:
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        selected_logits = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        return selected_logits - logsumexp_values
    token_logprobs = []
    for logits_row, index_row in zip(logits, index):
        logprobs_row = logits_row.log_softmax(dim=-1)
        token_logprobs.append(
            torch.gather(logprobs_row, dim=-1, index=index_row.unsqueeze(-1)).squeeze(-1))
    return torch.stack(token_logprobs)


def response_naive(logits, index, keep):
    """Seed 001's gather: CE (log-prob + entropy) on the response rows only."""
    logp = logits.index_select(0, keep).log_softmax(dim=-1)
    lp = torch.gather(logp, -1, index.index_select(0, keep).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def cross_entropy(E, C, targets):
    return F.cross_entropy(E @ C.T, targets, reduction="none")


def logprob_entropy(E, C, targets):
    """What a PyTorch user writes for an RL head with entropy: fp32 log-softmax of the bf16 logits."""
    logp = (E @ C.T).float().log_softmax(-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def fused_peers():
    """(name, fn(E, C, targets) -> per-token cross-entropy) of the installed fused peers."""
    out = []
    try:
        from cut_cross_entropy import linear_cross_entropy
        out.append(("apple_cce", lambda E, C, t: linear_cross_entropy(E, C, t, reduction="none", impl="cce")))
    except ImportError as e:
        print(f"apple CCE not installed ({e}): skipped", flush=True)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def liger(E, C, t):
            r = LigerFusedLinearCrossEntropyFunction.apply(E, C, t, None, None, -100, 0.0, 0.0, "none")
            return r[0] if isinstance(r, tuple) else r
        out.append(("liger_fused_linear_ce", liger))
    except ImportError as e:
        print(f"liger-kernel not installed ({e}): skipped", flush=True)
    return out


_compiled = {}


def compiled(fn):
    # One compiled object per function so the fw/fwbw/dtype variants share its cache.
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


# --- float64 references (chunked so they fit beside the inputs) ---

def ref_logits(logits2d, index, entropy=False):
    rows, v = logits2d.shape
    chunk = max(1, (256 * MIB) // (v * 8))
    lps, ents = [], []
    for i in range(0, rows, chunk):
        logp = logits2d[i:i + chunk].double().log_softmax(-1)
        lps.append(logp.gather(-1, index[i:i + chunk].unsqueeze(-1)).squeeze(-1))
        if entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
        del logp
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


def ref_seed002(E, C, targets):
    # Vocab chunks merged with logaddexp: the same float64 log_softmax(E @ C.T) + gather,
    # without a float64 copy of C (4.4 GiB) or of the (N, V) logits.
    Ed = E.double()
    target_logit = (Ed * C[targets].double()).sum(-1)
    lse = torch.full((E.shape[0],), -math.inf, dtype=torch.float64, device=E.device)
    chunk = max(1, min(16384, (256 * MIB) // (E.shape[0] * 8)))
    for j in range(0, C.shape[0], chunk):
        lse = torch.logaddexp(lse, torch.logsumexp(Ed @ C[j:j + chunk].double().T, -1))
    return target_logit - lse


def max_err(x, ref):
    return (x.detach().double() - ref).abs().max().item()


# --- the measurement harness ---

def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def release(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def measure(call, leaves, dev, reps, is_compiled, err_fn):
    """Warm up, then time `reps` calls; returns (peak_extra_mb, median ms, error)."""
    cuda = dev.type == "cuda"

    def one_call():
        for t in leaves:  # free the previous call's gradients before the baseline is taken
            t.grad = None
        sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = call()
            end.record()
            sync(dev)
            return out, start.elapsed_time(end), torch.cuda.max_memory_allocated(dev) - base
        t0 = time.perf_counter()
        out = call()
        return out, (time.perf_counter() - t0) * 1e3, None

    # The first warm-up's output gives the error, so measured calls keep nothing alive.
    out, prev, _ = one_call()
    err = err_fn(out)
    del out
    # Compiled peers keep warming until compiled (the call stops getting faster); 2 for eager.
    for i in range(1, 10 if is_compiled else 2):
        out, t, _ = one_call()
        del out
        if is_compiled and i >= 2 and t > 0.8 * prev:
            break
        prev = t
    times, peak = [], None
    for _ in range(reps):
        out, t, p = one_call()
        del out
        times.append(t)
        peak = p if peak is None else max(peak, p)
    for t in leaves:
        t.grad = None
    return (None if peak is None else peak / MIB), statistics.median(times), err


def guarded(fn):
    """Runs fn(); on OOM returns (None, 'OOM: <first line>') with everything freed."""
    msg = None
    try:
        return fn(), None
    except OOM_ERRORS as e:
        msg = "OOM: " + (str(e).strip().splitlines() or ["?"])[0]
    # Outside the except block: the traceback and the tensors its frames held are gone.
    return None, msg


KEYS = ("case", "impl", "dtype", "pass", "rows", "vocab", "hidden", "logits_mb",
        "peak_extra_mb", "ms", "max_abs_err", "lower_bound_mb", "note")


class Runner:
    def __init__(self, args):
        self.dev = torch.device(args.device)
        self.reps = args.reps
        self.records = []

    def run(self, base, impl, fn, is_compiled, pass_, make_call, leaves, err_fn, **extra):
        fields = dict(base, impl=impl, peak_extra_mb=None, ms=None, max_abs_err=None, note="",
                      **{"pass": pass_})
        rec = {k: fields.pop(k) for k in KEYS}  # the schema's order, then the case's extras
        rec.update(fields, **extra)
        if is_compiled and self.dev.type == "cpu":
            rec["note"] = "skipped on cpu"
        else:
            res, msg = guarded(lambda: measure(make_call(fn), leaves, self.dev, self.reps,
                                               is_compiled, err_fn))
            for t in leaves:
                t.grad = None
            release(self.dev)
            if msg is not None:
                rec["note"] = msg
            else:
                rec["peak_extra_mb"], rec["ms"], err = res
                if isinstance(err, tuple):  # seed001: (logprob error, entropy error)
                    err, ent_err = err
                    if ent_err is not None:
                        rec["note"] = f"entropy max_abs_err={ent_err:.3g}"
                rec["max_abs_err"] = err
        self.records.append(rec)
        print_row(rec)


def fmt(x, spec):
    return format("-", ">" + spec.split(".")[0]) if x is None else format(x, spec)


HEADER = (f"{'case':8} {'impl':28} {'dtype':5} {'pass':5} {'rows':>7} {'logits_mb':>10} "
          f"{'peak_extra_mb':>13} {'lower_bd_mb':>11} {'ms':>9} {'max_abs_err':>11}  note")


def print_row(r):
    extra = (f"frac={r['response_frac']:g} resp_rows={r['response_rows']} "
             if "response_frac" in r else "")
    print(f"{r['case']:8} {r['impl']:28} {r['dtype']:5} {r['pass']:5} {r['rows']:>7} "
          f"{r['logits_mb']:>10.1f} {fmt(r['peak_extra_mb'], '13.1f')} "
          f"{r['lower_bound_mb']:>11.4g} {fmt(r['ms'], '9.3f')} "
          f"{fmt(r['max_abs_err'], '11.3g')}  {(extra + r['note'])[:110]}", flush=True)


def fw_call(body):
    def call():
        with torch.no_grad():
            return body()
    return call


# --- the cases ---

def case_seed000(R, scale):
    dev, V = R.dev, 32768
    rows = scaled(16 * 1024, scale)
    # take2 loops over the first dim: keep 16 sequences when the scaled rows allow it.
    B = math.gcd(rows, 16)
    T = rows // B
    torch.manual_seed(0)
    logits32 = torch.randn(B, T, V, device=dev)
    index = torch.randint(0, V, (B, T), device=dev)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        logits = logits32 if dtype == torch.float32 else logits32.to(dtype)
        if dtype != torch.float32:
            del logits32  # only the benchmarked dtype stays allocated
        ref, _ = ref_logits(logits.view(rows, V), index.view(rows))
        ref = ref.view(B, T)
        elem = logits.element_size()
        base = dict(case="seed000", dtype=name, rows=rows, vocab=V, hidden=0,
                    logits_mb=rows * V * elem / MIB, batch=B, seq=T)
        err_fn = lambda out: max_err(out, ref)  # noqa: E731
        peers = (("torch_naive_eager", naive, False), ("torch_take2", take2, False),
                 ("torch_compile_naive", compiled(naive), True))
        for impl, fn, is_c in peers:
            R.run(dict(base, lower_bound_mb=rows * 4 / MIB), impl, fn, is_c, "fw",
                  lambda f: fw_call(lambda: f(logits, index)), [], err_fn)
        leaf = logits.detach().requires_grad_(True)

        def fwbw(f):
            def call():
                out = f(leaf, index)
                out.sum().backward()
                return out.detach()
            return call
        for impl, fn, is_c in peers:
            R.run(dict(base, lower_bound_mb=rows * V * elem / MIB), impl, fn, is_c, "fwbw",
                  fwbw, [leaf], err_fn)
        del leaf, logits, ref
        release(dev)


def case_seed001(R, scale):
    dev, V = R.dev, 76032
    T = scaled(205280, scale)
    torch.manual_seed(0)
    logits = torch.randn(T, V, device=dev)  # 58.14 GiB at scale 1
    index = torch.randint(0, V, (T,), device=dev)
    leaf = logits.requires_grad_(True)
    base = dict(case="seed001", dtype="fp32", rows=T, vocab=V, hidden=0,
                logits_mb=T * V * 4 / MIB,
                # index_select's backward returns a full (T, V) gradient: the input is (T, V).
                lower_bound_mb=T * V * 4 / MIB)
    for frac in (1.0, 0.5, 0.25, 0.0625):
        n_resp = scaled(T, frac)
        # One packed sample whose response is its tail; the row pattern does not change
        # the memory, and index_select's speed hardly depends on it.
        keep = torch.arange(T - n_resp, T, device=dev)
        if n_resp * V <= 2**31:
            with torch.no_grad():
                ref_lp, ref_ent = ref_logits(logits.detach().index_select(0, keep),
                                             index.index_select(0, keep), entropy=True)
            err_fn = lambda out: (max_err(out[0], ref_lp), max_err(out[1], ref_ent))  # noqa
        else:
            ref_lp = ref_ent = None
            err_fn = lambda out: (None, None)  # noqa: E731

        def fwbw(f):
            def call():
                lp, ent = f(leaf, index, keep)
                (lp.sum() + ent.sum()).backward()
                return lp.detach(), ent.detach()
            return call
        R.run(base, "torch_response_naive_eager", response_naive, False, "fwbw", fwbw, [leaf],
              err_fn, response_frac=frac, response_rows=n_resp)
        del ref_lp, ref_ent, keep
        release(dev)
    del leaf, logits
    release(dev)


def case_seed002(R, scale):
    dev, V, D = R.dev, S2_V, S2_D
    N = scaled(S2_N, scale)
    E, C, targets = seed002_inputs(N, V, D, dev)
    ref = ref_seed002(E, C, targets)
    print(f"seed002: N={N} V={V} D={D} alpha={S2_ALPHA} sigma={S2_SIGMA} "
          f"mean target prob {ref.exp().mean().item():.3f}", flush=True)
    base = dict(case="seed002", dtype="bf16", rows=N, vocab=V, hidden=D,
                logits_mb=N * V * 2 / MIB)
    run_ce_peers(R, base, E, C, targets, ref,
                 (("torch_cross_entropy", cross_entropy, False),
                  ("torch_compile_cross_entropy", compiled(cross_entropy), True)), fw=True)
    del E, C, ref
    release(dev)


def run_ce_peers(R, base, E, C, targets, ref, peers, fw):
    """The cross-entropy peers (fw when asked, then fw+bw of the mean) and the fused ones, on E (N, D), C (V, D)."""
    N, D, V = E.shape[0], E.shape[1], C.shape[0]
    err_fn = lambda ce: max_err(-ce, ref)  # noqa: E731  (logprob = -ce)
    if fw:
        for impl, fn, is_c in peers:
            R.run(dict(base, lower_bound_mb=N * 4 / MIB), impl, fn, is_c, "fw",
                  lambda f: fw_call(lambda: f(E, C, targets)), [], err_fn)
    E_leaf = E.detach().requires_grad_(True)
    C_leaf = C.detach().requires_grad_(True)

    def fwbw(f):
        def call():
            ce = f(E_leaf, C_leaf, targets)
            ce.mean().backward()
            return ce.detach()
        return call
    for impl, fn, is_c in peers:
        R.run(dict(base, lower_bound_mb=(N * D + V * D) * 2 / MIB), impl, fn, is_c, "fwbw",
              fwbw, [E_leaf, C_leaf], err_fn)
    run_fused_peers(R, base, E, C, E_leaf, C_leaf, targets, err_fn)


def run_fused_peers(R, base, E, C, E_leaf, C_leaf, targets, err_fn):
    """apple CCE and Liger in the RL form: per-token values, backward of their sum."""
    N, D, V = E.shape[0], E.shape[1], C.shape[0]

    def fwbw(f):
        def call():
            ce = f(E_leaf, C_leaf, targets)
            (-ce).sum().backward()  # d(sum of log-probs): a per-token upstream gradient of ones
            return ce.detach()
        return call
    for impl, fn in fused_peers():
        R.run(dict(base, lower_bound_mb=N * 4 / MIB), impl, fn, False, "fw",
              lambda f: fw_call(lambda: f(E, C, targets)), [], err_fn, entropy=False)
        R.run(dict(base, lower_bound_mb=(N * D + V * D) * 2 / MIB), impl, fn, False, "fwbw",
              fwbw, [E_leaf, C_leaf], err_fn, entropy=False)


def case_peaked(R, scale):
    """seed002's shape on a trained-model-like softmax (scripts/dev/peaked_inputs.py: the CCE paper's Fig. 3), the
    targets sampled from each row's softmax, as bench_loss --case peaked (its own draw of the same construction)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dev"))
    from peaked_inputs import build
    dev, V, D = R.dev, S2_V, S2_D
    N = scaled(S2_N, scale)
    E64, C64, _ = build(N, V, D, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    targets = torch.cat([torch.multinomial(torch.softmax(E64[r:r + 512] @ C64.T, 1), 1, generator=g).squeeze(1)
                         for r in range(0, N, 512)])
    E, C = E64.to(torch.bfloat16), C64.to(torch.bfloat16)
    del E64, C64
    release(dev)
    ref = ref_seed002(E, C, targets)
    print(f"peaked: N={N} V={V} D={D} mean target prob {ref.exp().mean().item():.3f}", flush=True)
    base = dict(case="peaked", dtype="bf16", rows=N, vocab=V, hidden=D, logits_mb=N * V * 2 / MIB)
    run_ce_peers(R, base, E, C, targets, ref, (("torch_compile_cross_entropy", compiled(cross_entropy), True),),
                 fw=False)
    del E, C, ref
    release(dev)


HEADS = (("qwen2.5-0.5b", 896, 151936), ("llama3-8b", 4096, 128256))


def case_heads(R, scale):
    dev = R.dev
    N = scaled(8192, scale)
    for model, D, V in HEADS:
        E, C, targets = seed002_inputs(N, V, D, dev)
        ref = ref_seed002(E, C, targets)
        print(f"heads {model}: N={N} V={V} D={D} mean target prob {ref.exp().mean().item():.3f}", flush=True)
        base = dict(case="heads", dtype="bf16", rows=N, vocab=V, hidden=D, logits_mb=N * V * 2 / MIB, model=model)
        E_leaf = E.detach().requires_grad_(True)
        C_leaf = C.detach().requires_grad_(True)

        def fwbw(f):
            def call():
                lp, ent = f(E_leaf, C_leaf, targets)
                (lp.sum() + ent.sum()).backward()  # log-prob and entropy gradients, as bench_loss
                return lp.detach()
            return call
        err_lp = lambda out: max_err(out[0] if isinstance(out, tuple) else out, ref)  # noqa: E731
        for impl, fn, is_c in (("torch_logprob_entropy", logprob_entropy, False),
                               ("torch_compile_logprob_entropy", compiled(logprob_entropy), True)):
            R.run(dict(base, lower_bound_mb=N * 4 / MIB), impl, fn, is_c, "fw",
                  lambda f: fw_call(lambda: f(E, C, targets)), [], err_lp, entropy=True)
            R.run(dict(base, lower_bound_mb=(N * D + V * D) * 2 / MIB), impl, fn, is_c, "fwbw",
                  fwbw, [E_leaf, C_leaf], err_lp, entropy=True)
        run_fused_peers(R, base, E, C, E_leaf, C_leaf, targets, lambda ce: max_err(-ce, ref))
        del E, C, E_leaf, C_leaf, ref
        release(dev)


CASES = {"seed000": case_seed000, "seed001": case_seed001, "seed002": case_seed002, "heads": case_heads,
         "peaked": case_peaked}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")  # all: every case but peaked
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the row count")
    ap.add_argument("--json", help="write the records here as a JSON list")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available (use --device cpu)")
    R = Runner(args)
    print(f"torch {torch.__version__} on {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    print(HEADER, flush=True)
    for name in ([c for c in CASES if c != "peaked"] if args.case == "all" else [args.case]):
        CASES[name](R, args.scale)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(R.records, f, indent=1)
        print(f"wrote {len(R.records)} records to {args.json}")


if __name__ == "__main__":
    main()
