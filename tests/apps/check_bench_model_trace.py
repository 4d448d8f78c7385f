#!/usr/bin/env python3
"""bench_model --trace and scripts/dev/trace_summary.py on the CPU: the trace holds every phase, each with the
host's ATen calls, and the summary's arithmetic is what its docstring says.

- union_ms is the union of intervals, not their sum (overlapping kernels count once);
- outermost keeps an op only when no other op of its thread encloses it (nested calls would count twice);
- a real trace of a tiny random model has each phase, ATen calls in each, no kernels on the CPU, and the
  phases in the order bench_model runs them; its JSON records keep tokens_per_s = batch * tokens / seconds.

Usage: check_bench_model_trace.py BENCH_MODEL SOURCE_DIR. Exits non-zero on the first broken promise."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

PHASES = ["prefill+decode_greedy", "prefill", "prefill+decode_sample", "prefill", "rollout_eager", "extend_4x24",
          "extend_4x24_next", "extend_2x10"]


def load_summary(src):
    spec = importlib.util.spec_from_file_location("trace_summary", os.path.join(src, "scripts", "dev", "trace_summary.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_arithmetic(ts):
    # 0-10 and 5-20 overlap (20 us together), 30-40 is apart: 30 us = 0.030 ms. A sum would give 35 us.
    got = ts.union_ms([(5.0, 20.0), (0.0, 10.0), (30.0, 40.0)])
    assert abs(got - 0.030) < 1e-12, f"union_ms: {got} ms, expected 0.030"
    # An interval inside another adds nothing.
    got = ts.union_ms([(0.0, 100.0), (10.0, 20.0)])
    assert abs(got - 0.100) < 1e-12, f"union_ms nested: {got} ms, expected 0.100"
    ops = [{"name": "outer", "ts": 0.0, "dur": 50.0}, {"name": "inner", "ts": 10.0, "dur": 5.0},
           {"name": "next", "ts": 60.0, "dur": 5.0}]
    names = [e["name"] for e in ts.outermost(ops)]
    assert names == ["outer", "next"], f"outermost: {names}"


def main():
    binary, src = sys.argv[1], sys.argv[2]
    ts = load_summary(src)
    check_arithmetic(ts)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model")
        os.makedirs(model)
        config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32,
                  "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "num_hidden_layers": 2, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "max_position_embeddings": 512, "tie_word_embeddings": True, "hidden_act": "silu",
                  "torch_dtype": "float32"}
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(config, f)
        trace, records = os.path.join(tmp, "t", "trace.json"), os.path.join(tmp, "r", "records.json")
        os.makedirs(os.path.dirname(trace))
        args = [binary, "--model", model, "--device", "cpu", "--dtype", "float32", "--batch", "4", "--prompt-len", "8",
                "--new-tokens", "4", "--reps", "1", "--trace", trace, "--json", records]
        p = subprocess.run(args, capture_output=True, timeout=300)
        assert p.returncode == 0, f"bench_model exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}"
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        res = ts.summarize(events, top=5)
        got = [r["phase"] for r in res]
        assert got == PHASES, f"phases {got}, expected {PHASES}"
        for r in res:
            assert r["wall_ms"] > 0 and r["cpu_ops"] > 0 and r["top_level_ops"], f"phase {r['phase']}: {r}"
            assert r["kernels"] == 0 and r["gpu_busy_ms"] == 0, f"phase {r['phase']}: kernels on the CPU: {r}"
            for name, count, total, longest in r["top_level_ops"]:
                assert count >= 1 and 0 <= longest <= total <= r["wall_ms"] + 1e-6, f"{r['phase']} {name}"
        with open(records) as f:
            recs = json.load(f)
        modes = [r["mode"] for r in recs]
        assert modes == ["prefill", "decode_greedy", "decode_sample", "rollout_eager"], modes
        for r in recs:
            n = r["batch"] * (r["prompt_len"] if r["mode"] == "prefill" else r["new_tokens"])
            assert abs(r["tokens_per_s"] * r["seconds"] - n) < 1e-6 * n, f"{r['mode']}: tokens_per_s * seconds != {n}"
    print("bench_model --trace and trace_summary: OK")


if __name__ == "__main__":
    main()
