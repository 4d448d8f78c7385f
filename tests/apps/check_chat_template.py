"""build/bin/chat_template against transformers' own renderer (transformers.utils.chat_template_utils.
render_jinja_template, which apply_chat_template(tokenize=False) calls with the tokenizer's special tokens),
byte for byte, on every published template in the fixtures: system/user/assistant turns, multi-turn chats,
add_generation_prompt on and off, a tool call and its tool response with `tools` given (9-character
call ids, as Mistral requires), Qwen3's enable_thinking switch and reasoning_content, and the conversations
Gemma and Mistral refuse (exit code 2 with the template's own message); hostile templates stop with exit
code 2 within seconds, naming the limit they hit and the file. Rendering without lstrip_blocks or
without trim_blocks (the app's debug switches, a wrong renderer) must change at least one output: the
comparison can fail.

usage: check_chat_template.py CHAT_TEMPLATE_BIN FIXTURES_DIR
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import jinja2
from transformers.utils.chat_template_utils import render_jinja_template

binary, fixtures = sys.argv[1:3]
templates = sorted(f for f in os.listdir(os.path.join(fixtures, "templates")) if f.endswith(".jinja"))
BOS, EOS = "<s>", "</s>"

TOOLS = [{"type": "function", "function": {
    "name": "code_interpreter", "description": "Runs Python code and returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the code"}},
                   "required": ["code"]}}}]
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "code_interpreter", "arguments": {"code": "print(347 * 829)"}}}

CASES = {
    "user": ([{"role": "user", "content": "What is 2 + 3?"}], None, {}),
    "system_multi_turn": ([{"role": "system", "content": "You are a careful mathematician."},
                           {"role": "user", "content": "What is 2 + 3?"},
                           {"role": "assistant", "content": "2 + 3 = 5.\nAnswer: \\boxed{5}"},
                           {"role": "user", "content": "And 7 * 6?"}], None, {}),
    "multi_turn_no_system": ([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                              {"role": "user", "content": "Bye  \n"}], None, {}),
    "tool_round_trip": ([{"role": "user", "content": "Compute 347 * 829."},
                         {"role": "assistant", "content": "", "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call12345", "name": "code_interpreter", "content": "287663"},
                         {"role": "assistant", "content": "Answer: \\boxed{287663}"}], TOOLS, {}),
    "tools_offered": ([{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Compute 12 * 12."}],
                      TOOLS, {}),
    "thinking_off": ([{"role": "user", "content": "Think about 2 + 2."}], None, {"enable_thinking": False}),
    "thinking_on": ([{"role": "user", "content": "Think about 2 + 2."}], None, {"enable_thinking": True}),
    "reasoning_history": ([{"role": "user", "content": "First?"},
                           {"role": "assistant", "content": "<think>\nhmm, one\n</think>\n\nOne."},
                           {"role": "user", "content": "Second?"},
                           {"role": "assistant", "content": "Two.", "reasoning_content": "count on"}], None, {}),
    "refused_system": ([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}], None, {}),
    "refused_alternation": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None, {}),
}


def expected(template, messages, tools, extra, gen):
    try:
        out, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                       add_generation_prompt=gen, bos_token=BOS, eos_token=EOS, **extra)
        return 0, out[0]
    except jinja2.exceptions.TemplateError as e:
        return 2, str(e)


def ours(folder, messages, tools, extra, gen, debug=(), timeout=60):
    with open(os.path.join(folder, "m.json"), "w") as f:
        json.dump(messages, f)
    args = [binary, "--model", folder, "--messages", os.path.join(folder, "m.json")]
    if tools is not None:
        with open(os.path.join(folder, "t.json"), "w") as f:
            json.dump(tools, f)
        args += ["--tools", os.path.join(folder, "t.json")]
    if gen:
        args.append("--add-generation-prompt")
    for k, v in extra.items():
        args += ["--var", f"{k}={json.dumps(v)}"]
    args += list(debug)
    p = subprocess.run(args, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8", errors="replace")


failures, checked, refused, wrong_diffs = [], 0, 0, {"--debug-no-lstrip-blocks": 0, "--debug-no-trim-blocks": 0}
with tempfile.TemporaryDirectory() as tmp:
    for name in templates:
        with open(os.path.join(fixtures, "templates", name), encoding="utf-8") as f:
            template = f.read()
        folder = os.path.join(tmp, name)
        os.makedirs(folder)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": template, "bos_token": BOS, "eos_token": EOS}, f)
        for case, (messages, tools, extra) in CASES.items():
            for gen in (False, True):
                want_rc, want = expected(template, messages, tools, extra, gen)
                rc, out, err = ours(folder, messages, tools, extra, gen)
                checked += 1
                if want_rc == 2:
                    refused += 1
                    if rc != 2 or want not in err:
                        failures.append(f"{name} {case} gen={gen}: transformers raises {want!r}; ours exit {rc}: {err!r}")
                elif rc != 0 or out != want:
                    failures.append(f"{name} {case} gen={gen}: exit {rc} {err!r}\n ours {out!r}\n want {want!r}")
                elif case in ("system_multi_turn", "tool_round_trip"):
                    for flag in wrong_diffs:
                        rc2, out2, _ = ours(folder, messages, tools, extra, gen, debug=[flag])
                        wrong_diffs[flag] += rc2 == 0 and out2 != want
print(f"chat templates: {len(templates)} templates, {checked} renderings, {refused} refusals compared; "
      f"wrong renderers differ in {wrong_diffs}")

# Hostile templates (a template comes with a downloaded folder): each must end within seconds with exit 2
# and an error naming the limit and the file, never a crash (a negative return code) or a hang.
HOSTILE = {
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion depth limit"),
    "100,000 nested parentheses": ("{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}", "nesting depth limit"),
    "50,000 nested ifs": ("{% if true %}" * 50000 + "x" + "{% endif %}" * 50000, "nesting depth limit"),
    "range(10**8)": ("{% for i in range(10**8) %}{% endfor %}", "range length limit"),
    "two nested range(100000)": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                 "loop iteration limit"),
    "'x' * 10**10": ("{{ 'x' * 10**10 }}", "string size limit"),
}
with tempfile.TemporaryDirectory() as tmp:
    for case, (template, limit) in HOSTILE.items():
        folder = os.path.join(tmp, "hostile")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "chat_template.jinja")
        with open(path, "w") as f:
            f.write(template)
        start = time.monotonic()
        try:
            rc, out, err = ours(folder, [{"role": "user", "content": "hi"}], None, {}, True, timeout=20)
        except subprocess.TimeoutExpired:
            failures.append(f"hostile {case}: still running after 20 s")
            continue
        seconds = time.monotonic() - start
        if rc != 2 or limit not in err or path not in err or seconds > 10:
            failures.append(f"hostile {case}: exit {rc} after {seconds:.1f} s, want 2 naming {limit!r} and {path}: "
                            f"{err[:300]!r}")
    print(f"chat templates: {len(HOSTILE)} hostile templates checked")
for flag, n in wrong_diffs.items():
    if n == 0:
        failures.append(f"{flag}: no template rendered differently; the comparison could not catch it")
if failures:
    print("\n\n".join(failures[:15]))
    print(f"... {len(failures)} failures")
    sys.exit(1)
print("chat templates: byte-identical to transformers")
