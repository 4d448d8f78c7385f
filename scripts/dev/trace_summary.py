#!/usr/bin/env python3
"""Splits a Chrome trace from `bench_model --trace` (Kineto: CPU ops and CUDA kernels) by phase.

Each phase is a user scope named "phase:<name>" that ends in a device synchronisation, so its kernels
lie inside its wall-clock window. Per phase it reports:
  wall_ms       the scope's duration on the host;
  gpu_busy_ms   the union of kernel, memcpy and memset intervals inside the window (time the GPU worked);
  kernels       how many ran; busy_pct = gpu_busy / wall (low: the host, not the GPU, sets the pace);
  top-level ops the host's outermost ATen calls: total time, count and the longest call (launch cost
                and one-time costs such as a new shape's attention plan live here);
  top kernels   by total time, with count and mean.
Usage: scripts/dev/trace_summary.py TRACE.json [--top 12] [--json OUT.json]
"""
import argparse
import collections
import json


def union_ms(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1000.0


def outermost(ops):
    """Ops of one thread not nested inside another op of that thread."""
    out, stack_end = [], -1.0
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= stack_end:
            out.append(e)
            stack_end = e["ts"] + e["dur"]
    return out


def summarize(events, top):
    phases = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("phase:")]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    result = []
    for ph in sorted(phases, key=lambda e: e["ts"]):
        t0, t1 = ph["ts"], ph["ts"] + ph["dur"]
        dev = [e for e in device if e["ts"] >= t0 and e["ts"] + e["dur"] <= t1]
        ops = [e for e in cpu if e["tid"] == ph["tid"] and e["ts"] >= t0 and e["ts"] + e["dur"] <= t1]
        busy = union_ms([(e["ts"], e["ts"] + e["dur"]) for e in dev])
        kern = collections.defaultdict(lambda: [0, 0.0])
        for e in dev:
            k = kern[e["name"][:90]]
            k[0] += 1
            k[1] += e["dur"] / 1000.0
        top_ops = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for e in outermost(ops):
            o = top_ops[e["name"]]
            o[0] += 1
            o[1] += e["dur"] / 1000.0
            o[2] = max(o[2], e["dur"] / 1000.0)
        result.append({
            "phase": ph["name"][len("phase:"):],
            "wall_ms": ph["dur"] / 1000.0,
            "gpu_busy_ms": busy,
            "busy_pct": 100.0 * busy * 1000.0 / ph["dur"] if ph["dur"] else 0.0,
            "kernels": len(dev),
            "cpu_ops": len(ops),
            "top_level_ops": sorted(([n, c, t, m] for n, (c, t, m) in top_ops.items()), key=lambda x: -x[2])[:top],
            "top_kernels": sorted(([n, c, t] for n, (c, t) in kern.items()), key=lambda x: -x[2])[:top],
        })
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    res = summarize(events, a.top)
    for r in res:
        print(f"== {r['phase']}: wall {r['wall_ms']:.2f} ms, GPU busy {r['gpu_busy_ms']:.2f} ms "
              f"({r['busy_pct']:.0f}%), {r['kernels']} kernels, {r['cpu_ops']} ATen calls")
        print("   top-level host ops (ms, count, longest ms):")
        for n, c, t, m in r["top_level_ops"]:
            print(f"     {t:9.2f} {c:6d} {m:9.2f}  {n}")
        if r["top_kernels"]:
            print("   kernels (ms, count, mean us):")
            for n, c, t in r["top_kernels"]:
                print(f"     {t:9.2f} {c:6d} {1000 * t / c:9.1f}  {n}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
