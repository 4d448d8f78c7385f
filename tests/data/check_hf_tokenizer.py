"""tokenize (our C++ Tokenizer) against Hugging Face `tokenizers`, byte for byte, encode and decode:
  * the published tokenizer.json files of Qwen3, Llama-3.1 (byte-level BPE) and Mistral-7B-v0.3
    (byte-fallback BPE, Metaspace), with and without the post-processor's special tokens;
  * BPE tokenizers trained here with Qwen2's and Llama-3's pre-tokenizer settings;
  * on a corpus of 12,000+ lines built below (many scripts, emoji, code, whitespace runs, long digit
    strings, special tokens inside text, contractions, combining marks) plus multi-line texts;
  * invalid UTF-8: encoded through its bytes; decode returns Python's errors="replace" text (one U+FFFD
    per maximal invalid subsequence, as the library's lossy decode).
Two wrong tokenizers must fail the same comparison (the check can fail): Llama-3.1 with ignore_merges off,
and Qwen3 with its last merges dropped.

usage: check_hf_tokenizer.py TOKENIZE_BIN FIXTURES_DIR
"""
import json
import os
import random
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, Regex

tokenize_bin, fixtures = sys.argv[1:3]
failures = []

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus():
    rng = random.Random(1234)
    words = {
        "latin": ["the", "The", "quick", "brown", "fox", "don't", "WE'LL", "it's", "naïve", "café", "Straße", "œuvre"],
        "cjk": ["世界", "你好", "数学问题", "答案是", "東京", "한국어", "ひらがな", "カタカナ"],
        "cyrillic": ["Привет", "мир", "ЁЖИК", "задача"],
        "arabic": ["مرحبا", "بالعالم", "٣٤٥"],
        "hebrew": ["שלום", "עולם"],
        # Whole vocabulary entries that merges alone do not rebuild: Llama-3's ignore_merges decides them.
        "turkish_czech_vietnamese": ["gerektiğini", "meydana", "problémy", "přičemž", "kiểu", "küçük", "fırsat",
                                     "neredeyse", "Việt", "nhiễm", "Cumhuriyeti", "ремонт", "스타", "Arthropoda"],
        "devanagari": ["नमस्ते", "दुनिया", "१२३"],
        "thai": ["สวัสดี", "ชาวโลก"],
        "greek": ["Καλημέρα", "κόσμε", "αβγ"],
        "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵", "❤️", "🤖"],
        "combining": ["e\u0301", "a\u0308\u0301", "\u1e9b\u0323", "n\u0303o", "Å", "Å"],
        "math": ["\\boxed{42}", "$x^2+y^2$", "\\frac{1}{2}", "∑_{i=1}^n", "≤", "∞", "π≈3.14159"],
        "code": ["def f(x):", "    return x*2", "print(347 * 829)", "for i in range(10):", "if a != b:", "{'k': [1, 2]}",
                 "x += 1  # comment", "import numpy as np", "\tindent\ttab", "}}}"],
        "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<|begin_of_text|>",
                    "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]", "<think>", "<|im_start|>assistant"],
    }
    groups = list(words)
    spaces = [" ", "  ", "   ", "\t", " \t ", "\r", "\u00a0", "\u3000", "        ", ""]
    lines = []
    for i in range(12000):
        kind = i % 7
        if kind == 0:  # digits
            lines.append(str(rng.randrange(10 ** rng.randrange(1, 40))) + rng.choice(["", ".5", ",000", " apples"]))
        else:
            n = rng.randrange(1, 14)
            parts = []
            for _ in range(n):
                g = rng.choice(groups)
                parts.append(rng.choice(words[g]))
                parts.append(rng.choice(spaces))
            lines.append("".join(parts))
    lines += ["", " ", "   leading", "trailing   ", "a  b   c    d", "'s 'S 'LL 'Ve", "don't DON'T", "1234567890" * 5,
              "<|im_start|>user\\nWhat is 2+2?<|im_end|>", "x<|im_end|>y", "<|im_end|><|im_end|>", "<<|im_end|>>"]
    return lines


MULTILINE = ["line one\nline two\n\n\nthree", "def f():\n    return 1\n\n", "\r\n\r\nwindows\r\n", "a\n \n b",
             "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]


def run(args, input_path):
    p = subprocess.run([tokenize_bin] + args + ["--file", input_path], capture_output=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"tokenize {args}: exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}")
    return [json.loads(line) for line in p.stdout.decode().splitlines()]


def ours_encode(tok_path, lines, tmp, special=False):
    path = os.path.join(tmp, "in.txt")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("\n".join(lines) + "\n")
    args = ["--tokenizer", tok_path] + (["--add-special-tokens"] if special else [])
    return [r["ids"] for r in run(args, path)]


def ours_decode(tok_path, id_lists, tmp):
    path = os.path.join(tmp, "ids.txt")
    with open(path, "w") as f:
        f.write("\n".join(",".join(map(str, ids)) for ids in id_lists) + "\n")
    return [r["text"] for r in run(["--tokenizer", tok_path, "--decode"], path)]


def ours_encode_text(tok_path, text):
    p = subprocess.run([tokenize_bin, "--tokenizer", tok_path, "--text", text], capture_output=True, timeout=60)
    return json.loads(p.stdout.decode())["ids"]


def compare(name, tok_json, hf, lines, tmp):
    """Returns the number of mismatching lines (encode or decode); records the first few."""
    bad = 0
    for special in (False, True):
        ours = ours_encode(tok_json, lines, tmp, special)
        want = [e.ids for e in hf.encode_batch(lines, add_special_tokens=special)]
        for line, a, b in zip(lines, ours, want):
            if a != b:
                bad += 1
                if bad <= 3:
                    failures.append(f"{name} encode(special={special}) {line!r}:\n ours {a[:40]}\n want {b[:40]}")
        if len(ours) != len(want):
            bad += 1
            failures.append(f"{name}: {len(ours)} outputs for {len(want)} lines")
    ids = [e.ids for e in hf.encode_batch(lines, add_special_tokens=True)]
    texts = ours_decode(tok_json, ids, tmp)
    for got, want_ids in zip(texts, ids):
        want = hf.decode(want_ids, skip_special_tokens=False)
        if got != want:
            bad += 1
            if bad <= 6:
                failures.append(f"{name} decode {want_ids[:20]}:\n ours {got!r}\n want {want!r}")
    for text in MULTILINE:
        a, b = ours_encode_text(tok_json, text), hf.encode(text, add_special_tokens=False).ids
        if a != b:
            bad += 1
            failures.append(f"{name} multi-line {text!r}: ours {a} want {b}")
    return bad


def trained(pattern, tmp, name, lines):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines[:3000], trainer=trainer)
    path = os.path.join(tmp, name + ".json")
    tok.save(path)
    return path


lines = corpus()
assert len(lines) >= 10000
tok_dir = os.path.join(fixtures, "tokenizers")
with tempfile.TemporaryDirectory() as tmp:
    for fam in ("qwen3", "llama-3.1", "mistral-7b-v0.3"):
        path = os.path.join(tok_dir, fam, "tokenizer.json")
        n = compare(fam, path, Tokenizer.from_file(path), lines, tmp)
        print(f"{fam}: {len(lines)} lines, {n} mismatches")
    for name, pattern in (("trained-qwen2", QWEN2_SPLIT), ("trained-llama3", LLAMA3_SPLIT)):
        path = trained(pattern, tmp, name, lines)
        n = compare(name, path, Tokenizer.from_file(path), lines, tmp)
        print(f"{name}: {n} mismatches")

    # The sentencepiece models (Mistral-7B-v0.3's, Llama-2's) against the sentencepiece library itself;
    # Mistral's also against its tokenizer.json (the same ids, as the fast tokenizer was converted from it).
    import sentencepiece as spm
    for fam in ("mistral-7b-v0.3", "llama-2"):
        model = os.path.join(tok_dir, fam, "tokenizer.model")
        sp = spm.SentencePieceProcessor(model_file=model)
        ours = ours_encode(model, lines, tmp)
        want = sp.encode(lines)
        bad = sum(a != b for a, b in zip(ours, want))
        texts = ours_decode(model, want, tmp)
        bad += sum(t != sp.decode(ids) for t, ids in zip(texts, want))
        print(f"{fam} sentencepiece: {bad} mismatches")
        if bad:
            first = next(i for i, (a, b) in enumerate(zip(ours, want)) if a != b)
            failures.append(f"{fam} sentencepiece {lines[first]!r}: ours {ours[first][:30]} want {want[first][:30]}")

    # Invalid UTF-8: every byte survives encoding (through the byte-level alphabet); decode is lossy.
    qwen = os.path.join(tok_dir, "qwen3", "tokenizer.json")
    raw = [b"abc\xff\xfedef", b"\xe4\xb8", b"ok \xc3\x28 x", b"\xf0\x9f\x98"]
    path = os.path.join(tmp, "invalid.txt")
    with open(path, "wb") as f:
        f.write(b"\n".join(raw) + b"\n")
    enc = [r["ids"] for r in run(["--tokenizer", qwen], path)]
    dec = ours_decode(qwen, enc, tmp)
    for r, ids, text in zip(raw, enc, dec):
        if text != r.decode("utf-8", errors="replace"):
            failures.append(f"invalid UTF-8 {r!r}: decoded {text!r}, want {r.decode('utf-8', errors='replace')!r}")

    # Wrong tokenizers: the same comparison must catch them.
    for fam, mutate in (("llama-3.1", lambda j: j["model"].__setitem__("ignore_merges", False)),
                        ("qwen3", lambda j: j["model"].__setitem__("merges", j["model"]["merges"][:-20000]))):
        src = os.path.join(tok_dir, fam, "tokenizer.json")
        with open(src) as f:
            j = json.load(f)
        mutate(j)
        wrong = os.path.join(tmp, fam + "-wrong.json")
        with open(wrong, "w") as f:
            json.dump(j, f)
        before = len(failures)
        n = compare(fam + " (wrong)", wrong, Tokenizer.from_file(src), lines, tmp)
        del failures[before:]
        print(f"{fam} wrong variant: {n} mismatches (must be > 0)")
        if n == 0:
            failures.append(f"{fam}: a wrong variant passed the comparison; the check cannot fail")

if failures:
    print("\n\n".join(failures[:20]))
    sys.exit(1)
print("tokenizer parity: all checks passed")
