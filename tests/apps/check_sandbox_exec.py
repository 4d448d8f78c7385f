#!/usr/bin/env python3
"""The sandbox_exec command-line contract: one JSON object with the documented keys on stdout; exit status 0
whenever the sandbox worked, whatever the code did (it raises, exits 3, is killed, times out); 2 for bad flags.

Usage: check_sandbox_exec.py PATH_TO_SANDBOX_EXEC. Exits non-zero on the first broken promise."""
import json
import subprocess
import sys
import time

KEYS = {"stdout", "stderr", "exit_code", "timed_out", "truncated", "wall_ms"}


def run(binary, args, code, timeout=30):
    start = time.monotonic()
    p = subprocess.run([binary] + args, input=code.encode(), capture_output=True, timeout=timeout)
    return p, time.monotonic() - start


def result(binary, args, code):
    p, wall = run(binary, args, code)
    where = f"{args} {code!r}: exit {p.returncode}, stderr {p.stderr.decode(errors='replace')!r}"
    assert p.returncode == 0, where
    lines = p.stdout.decode().strip().splitlines()
    assert len(lines) == 1, f"{where}: expected one JSON line, got {p.stdout!r}"
    r = json.loads(lines[0])
    assert KEYS <= set(r), f"{where}: keys {sorted(r)} lack {sorted(KEYS - set(r))}"
    assert isinstance(r["stdout"], str) and isinstance(r["stderr"], str), where
    assert isinstance(r["exit_code"], int) and not isinstance(r["exit_code"], bool), where
    assert isinstance(r["timed_out"], bool) and isinstance(r["truncated"], bool), where
    assert isinstance(r["wall_ms"], (int, float)) and r["wall_ms"] >= 0, where
    return r, wall


def main():
    binary = sys.argv[1]

    r, _ = result(binary, [], "print(6 * 7)")
    assert r["stdout"] == "42\n" and r["exit_code"] == 0 and not r["timed_out"], r
    print("ok: plain run, isolation:", r.get("isolation"))

    r, _ = result(binary, [], "raise ValueError('boom')")
    assert r["exit_code"] == 1 and "ValueError: boom" in r["stderr"], r
    print("ok: an exception is exit_code 1, status 0")

    r, _ = result(binary, [], "import sys\nprint('bye')\nsys.exit(3)")
    assert r["exit_code"] == 3 and r["stdout"] == "bye\n", r
    print("ok: sys.exit(3) is exit_code 3, status 0")

    r, _ = result(binary, [], "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert r["exit_code"] == 128 + 9 and not r["timed_out"], r
    print("ok: killed by a signal is 128 + signal")

    r, wall = result(binary, ["--timeout", "1"], "while True:\n  pass")
    assert r["timed_out"] and r["exit_code"] == 137, r
    assert wall < 5, f"--timeout 1 took {wall:.1f} s"
    print(f"ok: --timeout 1 stops an endless loop ({wall:.2f} s)")

    r, _ = result(binary, ["--max-output-bytes", "100"], "print('x' * 100000)")
    assert r["truncated"] and len(r["stdout"]) <= 100, r
    print("ok: output capped and marked truncated")

    r, _ = result(binary, ["--memory-mb", "256"], "x = bytearray(4 << 30)")
    assert r["exit_code"] == 1 and "MemoryError" in r["stderr"], r
    print("ok: --memory-mb bounds allocation")

    r, _ = result(binary, [], "import sys\nsys.stdout.buffer.write(b'\\xff bad utf-8')")
    assert r["stdout"] == "\ufffd bad utf-8", r
    print("ok: invalid UTF-8 in the output is replaced, the JSON stays valid")

    for args in (["--no-such-flag"], ["--timeout", "abc"], ["--timeout", "0"], ["--memory-mb", "-5"],
                 ["--python", ""], ["--tmp-root", "relative/dir"], ["extra-positional"]):
        p, _ = run(binary, args, "print(1)")
        assert p.returncode == 2, f"{args}: expected exit 2, got {p.returncode} ({p.stderr!r})"
        assert p.stderr.strip(), f"{args}: no message on stderr"
        assert not p.stdout.strip() or b"{" not in p.stdout, f"{args}: printed a result anyway"
    print("ok: bad flags exit 2 with a message")

    p, _ = run(binary, ["--python", "/nonexistent/python3"], "print(1)")
    assert p.returncode == 1 and p.stderr.strip(), f"a missing interpreter: exit {p.returncode} ({p.stderr!r})"
    print("ok: a sandbox failure exits 1 with a message")

    p, _ = run(binary, ["--help"], "")
    assert p.returncode == 0 and b"--timeout" in p.stdout, p
    print("ok: --help")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
