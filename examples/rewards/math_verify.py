"""A math-answer reward for reward.kind: python (docs/training.md, "Python rewards").

    reward:
      kind: python
      script: ../examples/rewards/math_verify.py   # from a file in configs/

The last \\boxed{...} of the response is compared with the reference answer by the first checker that is
importable in the sandbox:
  1. math_verify (pip install math-verify): its parse() of both, and verify(), which compares them as sympy
     expressions, sets, intervals or equations;
  2. sympy: both sides read by a small LaTeX reader (fractions, roots, powers, pi, implicit products) and
     compared by simplify(a - b) == 0, or as exact numbers;
  3. neither: the answers' texts, with spaces, $ and \\left / \\right removed.
A correct answer scores CORRECT, anything else WRONG (no box included), with the defaults of the built-in
boxed reward (reward.correct 1, reward.wrong -1); the dict's "correct" marks it for the accuracy metrics.
The fields "boxed" (a box was found) and "checker" (1 math_verify, 2 sympy, 3 text) are logged as
reward/boxed and reward/checker means.

math_verify's own timeouts are off (parsing_timeout=None, timeout_seconds=None): they use SIGALRM, which the
trainer's per-trajectory limit (sandbox.timeout_s) uses already.
"""
import re

CORRECT, WRONG = 1.0, -1.0

try:
    from math_verify import parse as mv_parse, verify as mv_verify
except ImportError:
    mv_parse = mv_verify = None

try:
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                            standard_transformations)
except ImportError:
    sympy = None


def last_boxed(text):
    """The content of the last \\boxed{...} (braces balanced), or None; a box never closed is no answer."""
    found = None
    start = text.find("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "\\":
                    j += 2
                    continue
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    break
                j += 1
            if j >= len(text):
                return None
            found = text[i + 1:j]
            start = text.find("\\boxed", j)
        else:
            start = text.find("\\boxed", i)
    return found


def plain(s):
    """The text of an answer without spaces, $, \\left, \\right, \\! and \\, and a trailing period."""
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\$|\s", "", s)
    return s[:-1] if s.endswith(".") else s


def braced(s, i):
    """(content, end) of the {group} or single character at s[i]."""
    if i < len(s) and s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            if depth == 0:
                return s[i + 1:j], j + 1
        raise ValueError("unbalanced braces")
    if i < len(s):
        return s[i], i + 1
    raise ValueError("missing argument")


def latex_to_sympy(s):
    """A sympy expression from simple LaTeX: \\frac, \\sqrt, ^, \\cdot, \\times, \\pi, implicit products."""
    s = plain(s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\^\\circ|\^\{\\circ\}|\\%|%", "", s)
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = braced(s, i + 5)
            den, i = braced(s, i)
            out.append("((%s)/(%s))" % (latex_to_sympy(num), latex_to_sympy(den)))
        elif s.startswith("\\sqrt", i):
            i += 5
            root = None
            if i < len(s) and s[i] == "[":
                end = s.index("]", i)
                root, i = s[i + 1:end], end + 1
            arg, i = braced(s, i)
            out.append("sqrt(%s)" % latex_to_sympy(arg) if root is None else
                       "((%s)**(1/(%s)))" % (latex_to_sympy(arg), latex_to_sympy(root)))
        elif s[i] == "^":
            arg, i = braced(s, i + 1)
            out.append("**(%s)" % latex_to_sympy(arg))
        elif s[i] in "{}":
            out.append("(" if s[i] == "{" else ")")
            i += 1
        elif s[i] == "\\":
            m = re.match(r"\\([a-zA-Z]+)", s[i:])
            name = m.group(1) if m else s[i + 1:i + 2]
            out.append({"cdot": "*", "times": "*", "pi": "pi", "infty": "oo"}.get(name, " " + name + " "))
            i += 1 + len(name)
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def sympy_equal(pred, ref):
    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)
    a = parse_expr(latex_to_sympy(pred), transformations=transforms, evaluate=True)
    b = parse_expr(latex_to_sympy(ref), transformations=transforms, evaluate=True)
    if a == b:
        return True
    diff = sympy.simplify(a - b)
    return diff == 0 or (diff.is_number and abs(complex(diff.evalf())) < 1e-12 * max(1.0, abs(complex(b.evalf()))))


def check(pred, ref):
    """(equal, checker): the first checker that reaches a verdict."""
    if mv_parse is not None:
        gold = mv_parse("$" + ref + "$", parsing_timeout=None)
        guess = mv_parse("\\boxed{" + pred + "}", parsing_timeout=None)
        if gold and guess:
            return bool(mv_verify(gold, guess, timeout_seconds=None)), 1
    if sympy is not None:
        try:
            return bool(sympy_equal(pred, ref)), 2
        except Exception:  # not an expression this reader knows: the texts decide
            pass
    return plain(pred) == plain(ref), 3


def reward(prompt, response, answer):
    box = last_boxed(response)
    if box is None or not plain(box):
        return {"score": WRONG, "correct": False, "boxed": 0.0}
    equal, checker = check(box, answer)
    return {"score": CORRECT if equal else WRONG, "correct": equal, "boxed": 1.0, "checker": float(checker)}
