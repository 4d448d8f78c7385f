#!/usr/bin/env python3
"""Command-line contract of `score`, and its log-probs against transformers.

Usage: check_score.py BIN REFS_DIR

REFS_DIR holds the case folders made by tests/model/make_reference.py (config.json, model.safetensors,
reference.json with "ids" [24] and "logits" [24][256], the transformers forward in float32). For every
case and every loss.impl (naive, selective, cce), `BIN --model DIR --ids ... --json` must return
logprobs[i] = log_softmax(logits[i])[ids[i+1]] (computed here in float64) within kTol. Bad input must
exit with code 2 and a message on stderr. The --text path is checked against the Python sentencepiece
encoding when that package is importable (printed SKIP otherwise).
Exits non-zero, naming every failure, when anything is wrong.
"""

import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

# Max abs log-prob error vs the float64 log_softmax of transformers' float32 logits. Both sides run the
# same float32 model; the logits agree to ~1e-5 (test_transformer), and a log-prob adds an fp32
# log-sum-exp over 256 entries on top. A wrong row alignment or a missing softcap moves log-probs by
# O(0.1-1), far above this.
TOL = 1e-4
# bf16 weights and activations vs the float32 reference: a smoke check only (the model runs in bf16, 3
# layers with init std 0.2; measured 0.04-0.29 on CPU). A misaligned row is off by several nats.
TOL_BF16 = 0.5
IMPLS = ["naive", "selective", "cce"]

failures = []


def fail(msg):
    print("FAIL: " + msg, flush=True)
    failures.append(msg)


def run(bin_path, args):
    try:
        return subprocess.run([bin_path] + args, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None


def expected_logprobs(ids, logits):
    """float64 log_softmax(logits[i])[ids[i+1]] for i < len(ids) - 1, in pure Python."""
    out = []
    for i in range(len(ids) - 1):
        row = logits[i]
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
        out.append(row[ids[i + 1]] - lse)
    return out


def run_json(bin_path, args, what):
    """Runs BIN with --json; returns the parsed object or None (after recording the failure)."""
    r = run(bin_path, args + ["--json"])
    if r is None:
        fail("%s: timed out" % what)
        return None
    if r.returncode != 0:
        fail("%s: exit code %d, stderr: %s" % (what, r.returncode, r.stderr.strip()[-500:]))
        return None
    try:
        out = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        fail("%s: stdout is not one JSON object (%s): %r" % (what, e, r.stdout[:300]))
        return None
    if not isinstance(out, dict) or set(out) != {"ids", "logprobs"}:
        fail("%s: JSON keys %s, want exactly ids and logprobs" % (what, sorted(out) if isinstance(out, dict) else out))
        return None
    return out


def check_case(bin_path, case_dir, devices):
    name = os.path.basename(case_dir)
    with open(os.path.join(case_dir, "reference.json")) as f:
        ref = json.load(f)
    ids, logits = ref["ids"], ref["logits"]
    want = expected_logprobs(ids, logits)
    # Known-bad input (STYLE.md, 7): scoring ids[i] instead of ids[i+1]; every tolerance must reject it.
    misaligned = expected_logprobs([ids[0]] + ids[:-1], logits)
    ids_arg = ",".join(str(i) for i in ids)
    runs = [(dev, "float32", impl, TOL) for dev in devices for impl in IMPLS]
    runs += [(dev, "bfloat16", "cce", TOL_BF16) for dev in devices]
    results = {}
    for dev, dtype, impl, tol in runs:
        what = "%s %s %s loss.impl=%s" % (name, dev, dtype, impl)
        args = ["--model", case_dir, "--ids", ids_arg, "--set", "loss.impl=" + impl, "--device", dev, "--dtype", dtype]
        out = run_json(bin_path, args, what)
        if out is None:
            continue
        got = out["logprobs"]
        if out["ids"] != ids:
            fail("%s: ids %s, want %s" % (what, out["ids"], ids))
            continue
        if len(got) != len(ids) - 1:
            fail("%s: %d logprobs, want %d" % (what, len(got), len(ids) - 1))
            continue
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in got):
            fail("%s: non-finite log-probs %s" % (what, got))
            continue
        err = max(abs(g - w) for g, w in zip(got, want))
        worst = max(range(len(got)), key=lambda i: abs(got[i] - want[i]))
        status = "ok" if err <= tol else "FAIL"
        print("%-20s %-5s %-9s %-10s max_abs_err %.3e (tol %.0e) %s" % (name, dev, dtype, impl, err, tol, status),
              flush=True)
        if err > tol:
            fail(
                "%s: max abs diff %.3e > %.0e vs transformers (row %d: got %.6f want %.6f)"
                % (what, err, tol, worst, got[worst], want[worst])
            )
        if max(abs(g - w) for g, w in zip(got, misaligned)) <= tol:
            fail("%s: the tolerance cannot tell a one-row misalignment apart" % what)
        if dtype == "float32":
            results[(dev, impl)] = got
    # The paths must agree with each other too (same model, same rows).
    if len(results) == len(devices) * len(IMPLS):
        spread = max(max(v[i] for v in results.values()) - min(v[i] for v in results.values()) for i in range(len(want)))
        if spread > TOL:
            fail("%s: loss.impl paths (and devices) disagree by %.3e > %.0e" % (name, spread, TOL))


def check_bad_inputs(bin_path, case_dir):
    """Each must exit with code 2 and say something on stderr; none may crash."""
    with open(os.path.join(case_dir, "reference.json")) as f:
        ids = json.load(f)["ids"]
    ids_arg = ",".join(str(i) for i in ids[:4])
    cases = [
        ("--ids 1,x", ["--model", case_dir, "--ids", "1,x"]),
        ("--ids 999999 (>= vocab)", ["--model", case_dir, "--ids", "1,999999"]),
        ("--ids with a negative id", ["--model", case_dir, "--ids", "1,-3"]),
        ("--ids with an empty item", ["--model", case_dir, "--ids", "1,,2"]),
        ("--model /nonexistent", ["--model", "/nonexistent", "--ids", ids_arg]),
        ("--model a folder without config.json", ["--model", os.path.dirname(case_dir), "--ids", ids_arg]),
        ("both --ids and --text", ["--model", case_dir, "--ids", ids_arg, "--text", "hello", "--tokenizer", "x"]),
        ("neither --ids nor --text", ["--model", case_dir]),
        ("--text without --tokenizer", ["--model", case_dir, "--text", "hello"]),
        ("unreadable --tokenizer", ["--model", case_dir, "--text", "hello", "--tokenizer", "/nonexistent.model"]),
        ("one id only", ["--model", case_dir, "--ids", "5"]),
        ("bad --set", ["--model", case_dir, "--ids", ids_arg, "--set", "loss.impl=bogus"]),
    ]
    tmp = tempfile.TemporaryDirectory()
    # Corrupt checkpoints: the weights cut in half, and a config.json that is not JSON.
    truncated = os.path.join(tmp.name, "truncated")
    bad_config = os.path.join(tmp.name, "bad_config")
    for d in (truncated, bad_config):
        os.makedirs(d)
        for fn in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(case_dir, fn), d)
    size = os.path.getsize(os.path.join(truncated, "model.safetensors"))
    with open(os.path.join(truncated, "model.safetensors"), "r+b") as f:
        f.truncate(size // 2)
    with open(os.path.join(bad_config, "config.json"), "w") as f:
        f.write("{not json")
    cases += [
        ("truncated model.safetensors", ["--model", truncated, "--ids", ids_arg]),
        ("config.json not JSON", ["--model", bad_config, "--ids", ids_arg]),
    ]
    if not cuda_available():
        cases.append(("--device cuda without a GPU", ["--model", case_dir, "--ids", ids_arg, "--device", "cuda"]))
    for what, args in cases:
        r = run(bin_path, args + ["--json"])
        if r is None:
            fail("bad input %s: timed out" % what)
            continue
        if r.returncode != 2 or not r.stderr.strip():
            fail("bad input %s: exit code %d (want 2), stderr %r" % (what, r.returncode, r.stderr.strip()[-300:]))
        else:
            print("bad input %-40s exit 2: %s" % (what, r.stderr.strip().splitlines()[-1][:150]), flush=True)
    tmp.cleanup()


def cuda_available():
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def check_text(bin_path, case_dir):
    if subprocess.run([sys.executable, "-c", "import sentencepiece"], capture_output=True).returncode != 0:
        print("SKIP --text path: the Python sentencepiece package is not importable", flush=True)
        return
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        # A small generated corpus: pseudo-words from a fixed set of syllables, so a unigram model of
        # 128 pieces can be trained (ids < 128 < 256, the tiny models' vocabulary).
        rng = random.Random(0)
        syllables = ["po", "li", "cy", "re", "ward", "to", "ken", "mo", "del", "sco", "va", "lue", "the", "an",
                     "gra", "di", "ent", "ka", "mu", "sen", "tri", "ol", "ex", "ing"]
        lines = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(12))
                 for _ in range(2000)]
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as f:
            f.write("\n".join(lines) + "\n")
        prefix = os.path.join(tmp, "tiny")
        spm.SentencePieceTrainer.train(
            input=corpus, model_prefix=prefix, vocab_size=128, model_type="unigram", character_coverage=1.0,
            hard_vocab_limit=False, minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
        text = "the policy gets a reward for every token of the model"  # also characters outside the corpus
        want_ids = sp.encode(text)
        if len(want_ids) < 2 or max(want_ids) >= 256:
            fail("--text: the test tokenizer gave %s (need >= 2 ids, all < 256)" % want_ids)
            return
        out = run_json(bin_path, ["--model", case_dir, "--text", text, "--tokenizer", prefix + ".model"], "--text")
        if out is None:
            return
        if out["ids"] != want_ids:
            fail("--text: ids %s, want the Python sentencepiece encoding %s" % (out["ids"], want_ids))
        elif len(out["logprobs"]) != len(want_ids) - 1:
            fail("--text: %d logprobs for %d ids" % (len(out["logprobs"]), len(want_ids)))
        else:
            print("--text: %d ids match the Python sentencepiece encoding" % len(want_ids), flush=True)
        # The table mode names the pieces.
        r = run(bin_path, ["--model", case_dir, "--text", text, "--tokenizer", prefix + ".model"])
        if r is None or r.returncode != 0 or sp.id_to_piece(want_ids[1]) not in r.stdout:
            fail("--text table: exit %s, no piece names in %r" % (r and r.returncode, r and r.stdout[:300]))


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: check_score.py BIN REFS_DIR")
    bin_path, refs = sys.argv[1], sys.argv[2]
    cases = sorted(
        os.path.join(refs, d) for d in os.listdir(refs) if os.path.isfile(os.path.join(refs, d, "reference.json"))
    )
    if not cases:
        sys.exit("FAIL: no case folders with reference.json under %s" % refs)
    # CUDA runs too where torch sees a GPU (it is then also checked against the same references).
    devices = ["cpu", "cuda"] if cuda_available() else ["cpu"]
    for case_dir in cases:
        check_case(bin_path, case_dir, devices)
    check_bad_inputs(bin_path, cases[0])
    check_text(bin_path, cases[0])
    if failures:
        print("\n%d failure(s):\n  %s" % (len(failures), "\n  ".join(failures)))
        sys.exit(1)
    print("all score checks passed (%d cases x %s on %s)" % (len(cases), ", ".join(IMPLS), ", ".join(devices)))


if __name__ == "__main__":
    main()
