"""Encode throughput of our tokenizer (build/bin/bench_tokenizer) beside Hugging Face `tokenizers`, one
thread each, on the same lines: the published Qwen3, Llama-3.1 and Mistral-7B-v0.3 tokenizer.json files.
The corpus (unless --file): the DAPO-Math and AIME 2024 fixture texts (LaTeX math in English), this
repository's C++ and Python sources (code), and a few multilingual lines, repeated to about --mb MB.
HF runs `encode` per line and `encode_batch` on all lines with RAYON_NUM_THREADS=1 (one thread: its batch
form saves the per-call overhead). Both keep a word cache, so every pass starts cold: ours is a fresh
process per pass, HF a freshly loaded Tokenizer; the corpus holds each line once unless --mb asks for more.
Token counts must agree (same work), or the script fails.

usage: bench_tokenizer.py BENCH_BIN FIXTURES_DIR [--file F] [--mb 0] [--reps 3]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("bench")
ap.add_argument("fixtures")
ap.add_argument("--file")
ap.add_argument("--mb", type=float, default=0.0)
ap.add_argument("--reps", type=int, default=3)
args = ap.parse_args()
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus_lines():
    lines = []
    for name in ("dapo_math_17k.head200.jsonl", "aime2024.jsonl"):
        for row in open(os.path.join(args.fixtures, "data", name), encoding="utf-8"):
            row = json.loads(row)
            text = row["prompt"][-1]["content"] if isinstance(row.get("prompt"), list) else row.get("problem", "")
            lines += text.split("\n")
    for pattern in ("**/*.cpp", "**/*.h", "**/*.py"):
        for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            if "/build" in path or "/.gpu" in path:
                continue
            lines += open(path, encoding="utf-8", errors="replace").read().split("\n")
    lines += ["数学问题的答案是 42。", "Привет, мир! Задача номер 7.", "Καλημέρα κόσμε", "こんにちは世界 😀👍🏽"] * 50
    lines = [l for l in lines if l]
    out, size = [], 0
    while size < max(args.mb * 1e6, 1):
        for l in lines:
            out.append(l)
            size += len(l.encode("utf-8"))
    return out


with tempfile.TemporaryDirectory() as tmp:
    path = args.file
    if not path:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(corpus_lines()) + "\n")
    lines = open(path, encoding="utf-8", newline="\n").read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    nbytes = sum(len(l.encode("utf-8")) for l in lines)
    print(f"corpus: {len(lines)} lines, {nbytes / 1e6:.2f} MB; one thread; median of {args.reps} cold passes")
    print("| tokenizer.json | ours encode MB/s | HF encode (per line) MB/s | HF encode_batch MB/s | ours / HF batch |"
          " ours decode MB/s |")
    print("|---|---|---|---|---|---|")
    failed = False
    for name in ("qwen3", "llama-3.1", "mistral-7b-v0.3"):
        tj = os.path.join(args.fixtures, "tokenizers", name, "tokenizer.json")
        runs = []
        for _ in range(args.reps):
            p = subprocess.run([args.bench, "--tokenizer", tj, "--file", path, "--reps", "1"], capture_output=True,
                               text=True)
            if p.returncode != 0:
                print(p.stderr, file=sys.stderr)
                sys.exit(1)
            runs.append(json.loads(p.stdout))
        ours = sorted(runs, key=lambda r: r["encode_mb_s"])[len(runs) // 2]
        per_line, batch = [], []
        for _ in range(args.reps):
            hf = Tokenizer.from_file(tj)
            t0 = time.perf_counter()
            n1 = sum(len(hf.encode(l, add_special_tokens=False).ids) for l in lines)
            t1 = time.perf_counter()
            hf = Tokenizer.from_file(tj)
            t2 = time.perf_counter()
            n2 = sum(len(e.ids) for e in hf.encode_batch(lines, add_special_tokens=False))
            t3 = time.perf_counter()
            per_line.append(t1 - t0)
            batch.append(t3 - t2)
        if not (n1 == n2 == ours["tokens"]):
            print(f"{name}: token counts differ: ours {ours['tokens']}, HF {n1} / {n2}", file=sys.stderr)
            failed = True
        hf_line = nbytes / statistics.median(per_line) / 1e6
        hf_batch = nbytes / statistics.median(batch) / 1e6
        print(f"| {name} | {ours['encode_mb_s']:.2f} | {hf_line:.2f} | {hf_batch:.2f} | "
              f"{ours['encode_mb_s'] / hf_batch:.2f}x | {ours['decode_mb_s']:.1f} |")
    sys.exit(1 if failed else 0)
