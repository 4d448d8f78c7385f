# The interpreter's run-and-exit time for a script delivered to a started interpreter, with and without site,
# and with a fast exit (os._exit after the script): what finalization costs on this host.
import subprocess, time, sys
for code in (b"pass\n", b"import os; os._exit(0)\n"):
    for flags in (["-I", "-S"], ["-I"]):
        ts = []
        for i in range(20):
            p = subprocess.Popen([sys.executable, *flags, "-B", "-u", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            time.sleep(0.3)
            t0 = time.perf_counter()
            p.communicate(code)
            ts.append((time.perf_counter() - t0) * 1e3)
        ts.sort()
        print(code, flags, "median ms %.2f p10 %.2f p90 %.2f" % (ts[10], ts[2], ts[18]))
for flags in (["-I", "-S"], ["-I"]):
    ts = []
    for i in range(20):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *flags, "-c", "pass"])
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    print("cold", flags, "median ms %.2f" % ts[10])
