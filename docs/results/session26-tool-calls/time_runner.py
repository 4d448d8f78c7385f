# The runner's first version (917fb13) against its revision, back to back on one machine: a started
# interpreter is handed the script on stdin, and the clock runs until the process is gone (median of 9).
# Run from the repository root: python3 docs/results/session26-tool-calls/time_runner.py
import re, subprocess, sys, time

def runner(source):
    return re.search(r'R"PY\((.*?)\)PY"', source, re.S).group(1)

old = runner(subprocess.run(["git", "show", "917fb13:rollout/sandbox.cpp"], capture_output=True, text=True).stdout)
new = runner(open("rollout/sandbox.cpp").read())
for code in (b"print(1)\n", b"import numpy, sympy\nprint(numpy.arange(3).sum(), sympy.sqrt(8))\n"):
    for name, r in (("first", old), ("revised", new), ("first", old), ("revised", new)):
        ts = []
        for _ in range(9):
            p = subprocess.Popen([sys.executable, "-I", "-B", "-u", "-c", r, "-"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE)
            time.sleep(0.3)
            t0 = time.perf_counter()
            p.communicate(code)
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        print(code.split(b"\n")[0].decode(), name, "median %.2f ms" % ts[4])
