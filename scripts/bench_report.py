#!/usr/bin/env python3
"""Merges bench_loss (C++) and bench_peers.py (PyTorch) JSON records into markdown tables, one per
case, ours first, peers after, grouped by dtype and pass. Used to write docs/benchmarks.md.

Usage: python3 scripts/bench_report.py DIR   (DIR holds bench_cpp.json and bench_peers.json)
"""
import json
import os
import sys


def fmt(v, digits=4):
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.1f}"
        return f"{v:.{digits}g}"
    return str(v)


def main():
    d = sys.argv[1]
    recs = []
    for name in ("bench_cpp.json", "bench_peers.json"):
        p = os.path.join(d, name)
        if os.path.exists(p):
            recs += json.load(open(p))
    order = {"fp32": 0, "bf16": 1, "fw": 0, "fwbw": 1}
    for case in ("seed000", "seed001", "seed002"):
        rows = [r for r in recs if r["case"] == case]
        if not rows:
            continue
        rows.sort(key=lambda r: (order.get(r["dtype"], 2), order.get(r["pass"], 2), -r.get("response_frac", 0),
                                 r["impl"].startswith("torch_"), r["impl"]))
        r0 = rows[0]
        print(f"\n### {case}: rows {r0['rows']}, vocab {r0['vocab']}" + (f", hidden {r0['hidden']}" if r0["hidden"] else "")
              + "\n")
        resp = any("response_frac" in r for r in rows)
        head = ["impl", "dtype", "pass"] + (["resp. frac"] if resp else []) + [
            "peak extra MiB", "extra / logits", "lower bound MiB", "ms", "max abs err", "note"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            # logits_mb by its definition: the [rows, vocab] logits in the input dtype.
            r["logits_mb"] = r["rows"] * r["vocab"] * (2 if r["dtype"] in ("bf16", "fp16") else 4) / 2**20
            extra = r.get("peak_extra_mb")
            ratio = extra / r["logits_mb"] if extra is not None and r["logits_mb"] else None
            cells = [r["impl"], r["dtype"], r["pass"]] + ([fmt(r.get("response_frac"))] if resp else []) + [
                fmt(extra), fmt(ratio, 3), fmt(r["lower_bound_mb"]), fmt(r.get("ms")), fmt(r.get("max_abs_err"), 3),
                (r.get("note") or "").replace("|", "/")[:70]]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
