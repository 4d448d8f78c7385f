"""What the app checks share: failures gathered as they are found, and the exit code at the end.

    from checks import expect, failures, finish
    expect("two steps", len(rows) == 2, log)   # a failure, with the log's tail, when not ok
    finish("critic: all checks passed")         # prints every failure and exits 1, else prints the line
"""
import sys

failures = []


def expect(what, ok, text=""):
    if not ok:
        failures.append(what + ("\n" + text[-3000:] if text else ""))


def finish(passed):
    if failures:
        print("\n\n".join("FAIL: " + f for f in failures))
        sys.exit(1)
    print(passed)
