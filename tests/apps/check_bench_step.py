#!/usr/bin/env python3
"""bench_step on the CPU: one record per (model, context, rows, variant), and each record's arithmetic is
what the app's header says.

- weight_bytes: every parameter once, the embedding only where it is the LM head. A tied and an untied
  model of the same shape both read one (V, D) matrix a step, so both report the layers' bytes plus V D
  bytes, counted here by hand from the config (a count that kept the untied embedding would differ by V D);
- kv_bytes = rows x context x layers x 2 x KV heads x head size x the element's bytes;
- tokens_per_s = rows / ms_per_step x 1000; idle = launch gaps + the host's turn; on the CPU no bandwidth
  is measured, so the floor is 0;
- a model folder that does not exist is exit code 2.

Usage: check_bench_step.py BENCH_STEP. Exits non-zero on the first broken promise."""
import json
import os
import subprocess
import sys
import tempfile

V, D, F, LAYERS, H, HKV = 400, 32, 64, 2, 4, 2


def config(tied):
    return {"model_type": "qwen2", "vocab_size": V, "hidden_size": D, "intermediate_size": F,
            "num_hidden_layers": LAYERS, "num_attention_heads": H, "num_key_value_heads": HKV,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": tied,
            "max_position_embeddings": 4096}


def layer_params():
    hd = D // H
    attn = (H * hd * D + H * hd) + 2 * (HKV * hd * D + HKV * hd) + D * H * hd  # q, k, v with biases; o
    mlp = 3 * F * D
    return LAYERS * (attn + mlp + 2 * D) + D  # two norms a layer, the final norm


def main():
    exe = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for name, tied in (("tied", True), ("untied", False)):
            d = os.path.join(tmp, name)
            os.makedirs(d)
            json.dump(config(tied), open(os.path.join(d, "config.json"), "w"))
            dirs.append(d)
        out = os.path.join(tmp, "step.json")
        rows, contexts, variants = [1, 3], [8, 20], ["default", "no_graph_draw", "no_dependent_launch",
                                                  "no_step_ahead"]
        subprocess.run([exe, "--models", ",".join(dirs), "--device", "cpu", "--dtype", "float32", "--rows",
                        ",".join(map(str, rows)), "--contexts", ",".join(map(str, contexts)), "--steps", "2",
                        "--reps", "1", "--variants", ",".join(variants), "--json", out], check=True,
                       stdout=subprocess.DEVNULL)
        recs = json.load(open(out))
        assert len(recs) == 2 * len(rows) * len(contexts) * len(variants), f"{len(recs)} records"
        seen = {(r["model"], r["rows"], r["context"], r["mode"]) for r in recs}
        assert len(seen) == len(recs), "a cell recorded twice"
        want_weights = 4 * (layer_params() + V * D)
        for r in recs:
            assert r["weight_bytes"] == want_weights, f"{r['model']}: weight_bytes {r['weight_bytes']}, by hand {want_weights}"
            kv = r["rows"] * r["context"] * LAYERS * 2 * HKV * (D // H) * 4
            assert r["kv_bytes"] == kv, f"kv_bytes {r['kv_bytes']}, by hand {kv}"
            assert r["ms_per_step"] > 0
            assert abs(r["tokens_per_s"] - r["rows"] / r["ms_per_step"] * 1e3) < 1e-6 * r["tokens_per_s"]
            assert r["floor_ms"] == 0 and r["hbm_bytes_per_s"] == 0, "no bandwidth is measured on the CPU"
            split = r["launch_gap_ms_per_step"] + r["host_ms_per_step"]
            assert abs(split - r["idle_ms_per_step"]) < 1e-9, "idle is the launch gaps plus the host's turn"
        # The known-bad count: the untied embedding kept would be V D bytes more.
        assert want_weights + 4 * V * D != recs[0]["weight_bytes"]
        rc = subprocess.run([exe, "--models", os.path.join(tmp, "absent"), "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        assert rc == 2, f"a missing model folder exits {rc}, not 2"
    print("bench_step: records and their arithmetic as documented")


if __name__ == "__main__":
    main()
