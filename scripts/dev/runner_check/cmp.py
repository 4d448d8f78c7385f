"""Runs each script through `python -I -B -u -` and through the sandbox's script runner
(`python -I -B -u -c RUNNER -`) on every interpreter given, and prints SAME or DIFF per pair, with both
outputs (stdout, stderr, exit status) for a DIFF, then the count.

usage: python3 scripts/dev/runner_check/cmp.py PYTHON[,PYTHON...] [SCRIPT...]
  SCRIPT defaults to scripts/dev/runner_check/scripts/*.py. The runner's source is $RUNNER if set, else
  the runner's Python file under rollout/, else the R"PY(...)PY" string in rollout/*.cpp. Run from the
  repository root.
"""
import glob
import os
import re
import subprocess
import sys


def runner_source():
    if os.environ.get("RUNNER"):
        return open(os.environ["RUNNER"]).read()
    for path in sorted(glob.glob("rollout/**/*runner*.py", recursive=True)):
        return open(path).read()
    for path in sorted(glob.glob("rollout/*.cpp")):
        m = re.search(r'R"PY\((.*?)\)PY"', open(path).read(), re.S)
        if m:
            return m.group(1)
    sys.exit("cmp.py: no runner source found (set RUNNER)")


runner = runner_source()
pythons = sys.argv[1].split(",")
scripts = sys.argv[2:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "scripts", "*.py")))
env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}


def norm(s):  # object addresses differ from run to run
    return re.sub(rb" at 0x[0-9a-f]+", b" at 0x", s)


def run(args, src):
    p = subprocess.run(args, input=src, capture_output=True, env=env, timeout=30)
    return (norm(p.stdout), norm(p.stderr), p.returncode)


same = total = 0
for f in scripts:
    src = open(f, "rb").read()
    for py in pythons:
        a = run([py, "-I", "-B", "-u", "-"], src)
        b = run([py, "-I", "-B", "-u", "-c", runner, "-"], src)
        total += 1
        same += a == b
        print(f"== {os.path.basename(f)} {py}: {'SAME' if a == b else 'DIFF'}")
        if a != b:
            print("  python -:", a)
            print("  runner  :", b)
print(f"{same} of {total} the same")
