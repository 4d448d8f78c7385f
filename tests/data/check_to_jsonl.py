"""scripts/to_jsonl.py on a parquet file shaped like verl's DAPO-Math-17k (data_source, prompt as a list of
{content, role}, ability, reward_model {ground_truth, style}, extra_info {index}): every row comes back as
the same nested JSON, and a binary column is refused with exit code 2 and no output file.

usage: check_to_jsonl.py SOURCE_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

src = sys.argv[1]
script = os.path.join(src, "scripts", "to_jsonl.py")
rows = [{"data_source": "math_dapo",
         "prompt": [{"content": f"What is {i} + {i}? Answer: \\boxed{{}}", "role": "user"}],
         "ability": "MATH",
         "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
         "extra_info": {"index": f"id-{i}"}} for i in range(5)]
failures = []
with tempfile.TemporaryDirectory() as tmp:
    pq.write_table(pa.Table.from_pylist(rows), os.path.join(tmp, "dapo.parquet"))
    out = os.path.join(tmp, "dapo.jsonl")
    p = subprocess.run([sys.executable, script, os.path.join(tmp, "dapo.parquet"), out], capture_output=True, text=True)
    if p.returncode != 0:
        failures.append(f"exit {p.returncode}: {p.stderr}")
    else:
        back = [json.loads(line) for line in open(out, encoding="utf-8")]
        if back != rows:
            failures.append(f"rows differ:\n{back[:2]}\n{rows[:2]}")
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "blob": b"\x00\x01"}]), os.path.join(tmp, "bin.parquet"))
    bad_out = os.path.join(tmp, "bin.jsonl")
    p = subprocess.run([sys.executable, script, os.path.join(tmp, "bin.parquet"), bad_out], capture_output=True, text=True)
    if p.returncode != 2 or "blob" not in p.stderr or os.path.exists(bad_out):
        failures.append(f"binary column: exit {p.returncode}, stderr {p.stderr!r}, output left: {os.path.exists(bad_out)}")
if failures:
    print("\n".join(failures))
    sys.exit(1)
print("to_jsonl: parquet rows round-trip as nested JSON")
