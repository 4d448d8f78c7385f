#!/usr/bin/env python3
"""Converts a parquet dataset (verl's DAPO-Math-17k, AIME, ...) to the JSONL the trainer reads: one JSON
object per row, nested structs as objects and lists as arrays, keys in the file's column order, so
data.prompt_key / data.answer_key (dotted: reward_model.ground_truth) reach the same fields.

usage: python3 scripts/to_jsonl.py IN.parquet OUT.jsonl [--limit N]

A column the trainer cannot read back (binary data) is an error naming the column and the row; nothing is
written then (the output goes to OUT.jsonl.tmp and is renamed at the end).
"""
import argparse
import json
import math
import os
import sys


def clean(value, where):
    if isinstance(value, bytes):
        raise ValueError(f"{where}: binary data, which a JSONL dataset cannot hold")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number")
    if isinstance(value, dict):
        return {k: clean(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return clean(value.tolist(), where)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ValueError(f"{where}: a {type(value).__name__}, which JSON cannot hold")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--limit", type=int, default=0, help="rows to convert; 0 = all")
    args = ap.parse_args()
    try:
        import pyarrow.parquet as pq
    except ImportError:
        sys.exit("to_jsonl: needs pyarrow (pip install pyarrow)")
    try:
        table = pq.read_table(args.input)
    except Exception as e:  # pyarrow raises several kinds for a missing or corrupt file
        print(f"to_jsonl: {args.input}: cannot read as parquet: {e}", file=sys.stderr)
        sys.exit(2)
    rows = table.to_pylist()
    if args.limit > 0:
        rows = rows[: args.limit]
    tmp = args.output + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                f.write(json.dumps(clean(row, f"{args.input}: row {i}: column"), ensure_ascii=False) + "\n")
    except ValueError as e:
        os.remove(tmp)
        print(f"to_jsonl: {e}", file=sys.stderr)
        sys.exit(2)
    os.replace(tmp, args.output)
    print(f"to_jsonl: {len(rows)} rows -> {args.output}")


if __name__ == "__main__":
    main()
