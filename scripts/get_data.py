#!/usr/bin/env python3
"""Downloads common math datasets from the Hugging Face Hub and writes them as the JSONL the trainer reads.

usage: python3 scripts/get_data.py [NAME ...] [--out DIR] [--from FILE]

NAME (default: dapo-math-17k):
  dapo-math-17k  BytedTsinghua-SIA/DAPO-Math-17k, data/dapo-math-17k.parquet (Apache-2.0): the ReTool/DAPO
                 training set. Written in the form data/dapo-math-17k-200.jsonl ships in, one
                 {"prompt": [{"content", "role"}], "label": ground_truth} per problem, so configs/retool.yaml
                 reads it with only data.path changed. Rows repeated in the published file are written once.
  gsm8k          openai/gsm8k, main/test-00000-of-00001.parquet (MIT): {"problem", "answer"}, the answer
                 being the number after the solution's "####" (thousands separators removed).
  math-500       HuggingFaceH4/MATH-500, test.jsonl: its rows as published ({"problem", "solution",
                 "answer", "subject", "level", "unique_id"}).
AIME 2024 ships in data/aime-2024.jsonl and needs no download.

Each file goes to DIR/NAME.jsonl (default DIR: data/), through a temporary file renamed at the end. The
download needs `huggingface_hub` (pip install huggingface_hub) and network access to the Hub; it cannot be
tested where this project's CI runs. The conversion can: `--from FILE` converts a file already on disk
(parquet or JSONL, in the published schema) instead of downloading, and tests/apps/check_get_data.py
checks it on the shipped DAPO sample. Parquet is read by scripts/to_jsonl.py's reader (pyarrow).
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import to_jsonl  # noqa: E402  (the parquet reader and JSON cleaning every converted row goes through)

SOURCES = {
    "dapo-math-17k": ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"),
    "gsm8k": ("openai/gsm8k", "main/test-00000-of-00001.parquet"),
    "math-500": ("HuggingFaceH4/MATH-500", "test.jsonl"),
}


def read_rows(path):
    """The rows of a parquet or JSONL file, as Python values (to_jsonl.clean applied)."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            sys.exit("get_data: reading parquet needs pyarrow (pip install pyarrow)")
        rows = pq.read_table(path).to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return [to_jsonl.clean(row, f"{path}: row {i}: column") for i, row in enumerate(rows)]


def field(row, dotted, where):
    value = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"{where}: no field '{dotted}'")
        value = value[key]
    return value


def dapo(rows, source):
    """verl's schema (prompt: [{role, content}], reward_model.ground_truth) -> {"prompt", "label"}."""
    out, seen = [], set()
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        messages = field(row, "prompt", where)
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'prompt' is not a list of chat messages")
        prompt = [{"content": field(m, "content", where), "role": field(m, "role", where)} for m in messages]
        line = json.dumps({"prompt": prompt, "label": field(row, "reward_model.ground_truth", where)})
        if line not in seen:
            seen.add(line)
            out.append(line)
    return out


def gsm8k(rows, source):
    out = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        solution = field(row, "answer", where)
        m = re.search(r"####\s*(.+?)\s*$", solution)
        if not m:
            raise ValueError(f"{where}: the answer has no '#### <number>' line")
        answer = m.group(1).replace(",", "")
        out.append(json.dumps({"problem": field(row, "question", where), "answer": answer}, ensure_ascii=False))
    return out


def as_published(rows, source):
    return [json.dumps(row, ensure_ascii=False) for row in rows]


CONVERT = {"dapo-math-17k": dapo, "gsm8k": gsm8k, "math-500": as_published}


def download(name):
    repo, filename = SOURCES[name]
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        sys.exit("get_data: downloading needs huggingface_hub (pip install huggingface_hub), or pass --from FILE")
    print(f"get_data: {name}: downloading {repo} {filename}")
    return hf_hub_download(repo_id=repo, filename=filename, repo_type="dataset")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("names", nargs="*", default=["dapo-math-17k"], metavar="NAME")
    ap.add_argument("--out", default="data", help="folder for NAME.jsonl (default: data)")
    ap.add_argument("--from", dest="source", default="",
                    help="convert this local file (the published schema) instead of downloading; one NAME")
    args = ap.parse_args()
    for name in args.names:
        if name not in SOURCES:
            print(f"get_data: unknown dataset '{name}' (known: {', '.join(SOURCES)})", file=sys.stderr)
            sys.exit(2)
    if args.source and len(args.names) != 1:
        print("get_data: --from converts one dataset; name exactly one", file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    for name in args.names:
        path = args.source or download(name)
        try:
            lines = CONVERT[name](read_rows(path), path)
        except (ValueError, OSError, json.JSONDecodeError) as e:
            print(f"get_data: {name}: {e}", file=sys.stderr)
            sys.exit(2)
        out = os.path.join(args.out, name + ".jsonl")
        with open(out + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
        os.replace(out + ".tmp", out)
        print(f"get_data: {name}: {len(lines)} rows -> {out}")


if __name__ == "__main__":
    main()
