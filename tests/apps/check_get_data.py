"""scripts/get_data.py's conversions, without the download: the shipped DAPO-Math sample
(data/dapo-math-17k-200.jsonl) written out in the Hub's parquet schema (verl's: prompt as [{role, content}],
reward_model.ground_truth, with a repeated row) must convert back to the shipped file byte for byte;
GSM8K's "#### 1,234" answers become "1234"; MATH-500 rows pass through as published; bad input exits 2,
naming the row. The byte comparison rejects a dropped row, a changed label and an unremoved repeat.

usage: check_get_data.py SOURCE_DIR
"""
import json
import os
import subprocess
import sys
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

src = sys.argv[1]
script = os.path.join(src, "scripts", "get_data.py")
shipped_path = os.path.join(src, "data", "dapo-math-17k-200.jsonl")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


def run(*args):
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)


def same_bytes(a, b):
    return a == b


with open(shipped_path, "rb") as f:
    shipped = f.read()
rows = [json.loads(line) for line in shipped.decode("utf-8").splitlines()]

with tempfile.TemporaryDirectory() as tmp:
    # The Hub's schema: role before content, the answer under reward_model, extra columns around them.
    verl = [{"data_source": "math_dapo",
             "prompt": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
             "ability": "MATH",
             "reward_model": {"ground_truth": r["label"], "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": str(i)}} for i, r in enumerate(rows)]
    verl.insert(7, dict(verl[3]))  # the published file repeats problems; a repeat is written once
    parquet = os.path.join(tmp, "dapo-math-17k.parquet")
    pq.write_table(pa.Table.from_pylist(verl), parquet)
    p = run("dapo-math-17k", "--from", parquet, "--out", tmp)
    check(p.returncode == 0, f"dapo conversion exit {p.returncode}: {p.stderr}")
    out_path = os.path.join(tmp, "dapo-math-17k.jsonl")
    got = open(out_path, "rb").read() if os.path.exists(out_path) else b""
    check(same_bytes(got, shipped), "the converted DAPO sample differs from data/dapo-math-17k-200.jsonl")
    check(not os.path.exists(out_path + ".tmp"), "the temporary file was left behind")

    # The comparison must reject a wrong conversion: a dropped row, a changed label, a repeat kept.
    lines = shipped.decode("utf-8").splitlines(keepends=True)
    changed = json.loads(lines[5])
    changed["label"] = changed["label"] + "0"
    wrong = {
        "a dropped row": "".join(lines[:-1]),
        "a changed label": "".join(lines[:5] + [json.dumps(changed) + "\n"] + lines[6:]),
        "a repeat kept": "".join(lines[:7] + [lines[3]] + lines[7:]),
    }
    for what, text in wrong.items():
        check(not same_bytes(text.encode("utf-8"), shipped), f"the byte comparison accepts {what}")

    # GSM8K: the number after ####, thousands separators removed; a row without it exits 2 naming it.
    gsm = [{"question": "Q1?", "answer": "work\n#### 1,234"}, {"question": "Q2 \u00e9?", "answer": "x\n####  72 "}]
    gsm_path = os.path.join(tmp, "gsm.parquet")
    pq.write_table(pa.Table.from_pylist(gsm), gsm_path)
    p = run("gsm8k", "--from", gsm_path, "--out", tmp)
    check(p.returncode == 0, f"gsm8k conversion exit {p.returncode}: {p.stderr}")
    got = [json.loads(line) for line in open(os.path.join(tmp, "gsm8k.jsonl"), encoding="utf-8")]
    check(got == [{"problem": "Q1?", "answer": "1234"}, {"problem": "Q2 \u00e9?", "answer": "72"}], f"gsm8k rows {got}")
    pq.write_table(pa.Table.from_pylist(gsm + [{"question": "Q3", "answer": "no final line"}]), gsm_path)
    p = run("gsm8k", "--from", gsm_path, "--out", tmp)
    check(p.returncode == 2 and "row 2" in p.stderr and "####" in p.stderr,
          f"a GSM8K row without '####': exit {p.returncode}, {p.stderr!r}")

    # MATH-500: JSONL rows as published.
    math = [{"problem": "1+1?", "solution": "2", "answer": "2", "subject": "Algebra", "level": 1,
             "unique_id": "test/algebra/1.json"}]
    math_path = os.path.join(tmp, "math.jsonl")
    with open(math_path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in math)
    p = run("math-500", "--from", math_path, "--out", tmp)
    got = [json.loads(line) for line in open(os.path.join(tmp, "math-500.jsonl"), encoding="utf-8")]
    check(p.returncode == 0 and got == math, f"math-500 rows {got} (exit {p.returncode}: {p.stderr})")

    # Bad input: an unknown name, and a DAPO row without its answer.
    p = run("nope", "--out", tmp)
    check(p.returncode == 2 and "unknown dataset 'nope'" in p.stderr, f"unknown name: {p.returncode} {p.stderr!r}")
    del verl[2]["reward_model"]
    pq.write_table(pa.Table.from_pylist(verl), parquet)
    p = run("dapo-math-17k", "--from", parquet, "--out", tmp)
    check(p.returncode == 2 and "row 2" in p.stderr and "reward_model.ground_truth" in p.stderr,
          f"a DAPO row without reward_model.ground_truth: exit {p.returncode}, {p.stderr!r}")

if failures:
    print("FAILED:\n" + "\n".join(failures))
    sys.exit(1)
print("get_data conversions: OK")
