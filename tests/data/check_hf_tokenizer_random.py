"""tokenize (our C++ tokenizer) against Hugging Face `tokenizers` on tokenizers built here, one per
pre-tokenizer and normalizer configuration that decoder LLMs ship, encoding and decoding seeded random
strings; ids and decoded text must match byte for byte:
  * ByteLevel with and without its regex (and add_prefix_space);
  * Split in each behavior (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous), with and
    without invert, on a regex with gaps and empty matches, then ByteLevel; the tiktoken-converted form
    (Removed + invert on the Llama-3 regex); Split with a String pattern;
  * Digits, individual or not (Unicode numerics: "½", "²", "٣");
  * Metaspace (prepend_scheme first / always, split or not) on a byte-fallback BPE with Mistral's decoder
    chain and with the Metaspace decoder;
  * NFC, NFKC, NFD, Lowercase, Strip, StripAccents, Nmt, ByteLevel, BertNormalizer and Replace (Regex)
    normalizers; Whitespace, WhitespaceSplit, CharDelimiterSplit, Punctuation, BertPreTokenizer and
    FixedLength; the Bert and Roberta post-processors (compared with add_special_tokens as well); the
    Replace (Regex) decoder;
  * ignore_merges with whole-word vocabulary entries the merges do not build;
  * added tokens: special, non-special matched in the raw text, non-special matched in the normalized
    text, lstrip / rstrip.
The strings mix scripts, digits and numerals, whitespace runs (newlines included), emoji with joiners,
control characters and the added tokens. The check can fail: a copy of the expected ids with one id
changed, and the Split configurations with invert flipped in our copy of the file, must both be reported
as mismatches. A file with a field the code does not read must be refused (exit 2, naming the field).

usage: check_hf_tokenizer_random.py TOKENIZE_BIN [N_STRINGS]   (3,000 strings; RLT_TOKENIZER_SEED
sets another seed)
"""
import json
import os
import random
import subprocess
import sys
import tempfile

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

tokenize_bin = sys.argv[1]
n_strings = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
SEED = int(os.environ.get("RLT_TOKENIZER_SEED", "20240611"))

# A pattern that leaves gaps between its matches and matches the empty string (x*), so that every
# behavior and invert give different pieces.
PARTIAL = r" ?\p{L}+|\p{N}{1,2}|[\r\n]+|x*"
TIKTOKEN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
RAW_ADDED = ["<tool>", "</tool>"]         # normalized=False: matched in the raw text
NORM_ADDED = ["[Calc]", "ﬁnal"]            # normalized=True: matched after the normalizer ("ﬁ" is NFKC "fi")
STRIPPED = ["<pad>"]                       # lstrip + rstrip

POOLS = {
    "latin": ["the", "The", "quick", "don't", "WE'LL", "naïve", "café", "Straße", "İstanbul", "ΣΊΣΥΦΟΣ", "hello", "world"],
    "scripts": ["世界", "你好", "数学", "東京", "한국어", "ひらがな", "Привет", "мир", "مرحبا", "שלום", "नमस्ते", "สวัสดี",
                "Καλημέρα", "ქართული", "አማርኛ"],
    "digits": ["0", "7", "12", "345", "6789", "3.14", "1,000", "½", "²", "⅓", "Ⅻ", "٣٤", "१२", "๓", "１２", "①", "¼x", "2²"],
    "space": [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2003", "\u2009", "\u200b",
              "\u2581", "      "],
    "emoji": ["😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳️\u200d🌈", "🇯🇵", "❤️", "🧑🏿\u200d💻", "\u200d"],
    "control": ["\x00", "\x01", "\x07", "\x1b", "\x7f", "\x85", "\ufeff", "\ufffd", "\u0301", "e\u0301", "\u00c5", "A\u030a",
                "\ue000", "\u0378", "\u200c", "\u0903", "\u20dd"],
    "rare": ["Ⓐ", "ǅ", "〇", "_x_", "\U00020000", "\uf900", "\U0002b820", "\U0002b920", "ﬀ", "Ⅻ", "İ", "ß", "\u2028", "\u1680"],
    "punct": ["'s", "'", "?", "!!", "...", "--", "$x^2$", "\\frac{1}{2}", "{", "}}", "(a)", "#", "→", "≤"],
    "added": SPECIAL + RAW_ADDED + NORM_ADDED + STRIPPED + ["<tool", "[calc]", "fi"],
}


def random_strings(n, seed):
    rng = random.Random(seed)
    groups = list(POOLS)
    out = ["", " ", "a", "  leading", "trailing  ", "\n", "½²⅓", "x ½ ² ⅓ y", "<|im_start|>", "ﬁnal [Calc]"]
    while len(out) < n:
        k = rng.randrange(1, 12)
        parts = []
        for _ in range(k):
            g = rng.choice(groups)
            parts.append(rng.choice(POOLS[g]))
            if rng.random() < 0.4:
                parts.append(rng.choice(POOLS["space"]))
        out.append("".join(parts))
    return out


def corpus(seed):
    return random_strings(600, seed)


def bytelevel_bpe(pre, normalizer=None, vocab_size=500, post=None):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    if post is not None:
        tok.post_processor = post
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(SEED), trainer=trainer)
    return tok


def with_added(tok):
    tok.add_tokens([AddedToken(t, normalized=False) for t in RAW_ADDED])
    tok.add_tokens([AddedToken(t, normalized=True) for t in NORM_ADDED])
    tok.add_tokens([AddedToken(t, lstrip=True, rstrip=True, normalized=False) for t in STRIPPED])
    return tok


def byte_fallback_bpe(pre, decoder):
    """A sentencepiece-style BPE: a small trained vocabulary, rare characters fall back to <0xXX>."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60,
                                  show_progress=False)
    tok.train_from_iterator(corpus(SEED + 1), trainer=trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(j))
    tok.decoder = decoder
    return tok


def ignore_merges_bpe():
    tok = bytelevel_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TIKTOKEN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = True
    vocab = j["model"]["vocab"]
    # Whole words as single entries the merges do not build: only ignore_merges finds them.
    for w in ["Ġquick", "Ġworld", "hello", "ĠStraÃŁe", "345", "Ġthe"]:
        vocab.setdefault(w, len(vocab))
    return Tokenizer.from_str(json.dumps(j))


MISTRAL_DECODER = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
BEHAVIORS = ["removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"]


def configurations():
    bl = lambda regex=False, prefix=False: pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=regex)
    seq = pre_tokenizers.Sequence
    out = {
        "bytelevel-regex": lambda: bytelevel_bpe(bl(regex=True)),
        "bytelevel-regex-prefix": lambda: bytelevel_bpe(bl(regex=True, prefix=True)),
        "bytelevel-no-regex": lambda: bytelevel_bpe(bl()),
        "split-string-merged-next": lambda: bytelevel_bpe(seq([
            pre_tokenizers.Split(" ", behavior="merged_with_next"), bl()])),
        "digits-individual": lambda: bytelevel_bpe(seq([pre_tokenizers.Digits(individual_digits=True), bl(regex=True)])),
        "digits-contiguous": lambda: bytelevel_bpe(seq([pre_tokenizers.Digits(individual_digits=False), bl()])),
        "nfc-added": lambda: with_added(bytelevel_bpe(seq([pre_tokenizers.Split(Regex(TIKTOKEN), "isolated"), bl()]),
                                                      normalizer=normalizers.NFC())),
        "nfkc-added": lambda: with_added(bytelevel_bpe(bl(regex=True), normalizer=normalizers.NFKC())),
        "lowercase-strip-whitespacesplit": lambda: with_added(bytelevel_bpe(
            seq([pre_tokenizers.WhitespaceSplit(), bl()]),
            normalizer=normalizers.Sequence([normalizers.Strip(), normalizers.Lowercase()]))),
        "chardelimiter": lambda: bytelevel_bpe(seq([pre_tokenizers.CharDelimiterSplit("e"), bl()])),
        "metaspace-first-bytefallback": lambda: byte_fallback_bpe(
            pre_tokenizers.Metaspace(prepend_scheme="first", split=False), MISTRAL_DECODER),
        "metaspace-always-split": lambda: byte_fallback_bpe(
            pre_tokenizers.Metaspace(prepend_scheme="always", split=True),
            decoders.Sequence([decoders.Metaspace(prepend_scheme="always"), decoders.ByteFallback(), decoders.Fuse()])),
        "metaspace-never-decoder": lambda: byte_fallback_bpe(
            pre_tokenizers.Metaspace(prepend_scheme="never", split=True),
            decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first"), decoders.Fuse()])),
        "ignore-merges": ignore_merges_bpe,
        "nmt-stripaccents-replace-regex": lambda: bytelevel_bpe(bl(regex=True), normalizer=normalizers.Sequence([
            normalizers.Nmt(), normalizers.NFD(), normalizers.StripAccents(),
            normalizers.Replace(Regex(r" {2,}"), "_"), normalizers.Replace(Regex(r"\d\d"), "#")])),
        "bytelevel-normalizer-punctuation": lambda: bytelevel_bpe(pre_tokenizers.Punctuation(),
                                                                  normalizer=normalizers.ByteLevel()),
        "whitespace-bertnormalizer": lambda: bytelevel_bpe(
            seq([pre_tokenizers.Whitespace(), bl()]), normalizer=normalizers.BertNormalizer()),
        "whitespace-bertnormalizer-keep-accents": lambda: bytelevel_bpe(
            seq([pre_tokenizers.Whitespace(), bl()]),
            normalizer=normalizers.BertNormalizer(strip_accents=False, lowercase=False)),
        "punctuation-removed": lambda: bytelevel_bpe(seq([pre_tokenizers.Punctuation("removed"), bl()])),
        "bert-pretokenizer-roberta": lambda: bytelevel_bpe(
            seq([pre_tokenizers.BertPreTokenizer(), bl()]),
            post=processors.RobertaProcessing(("<|im_end|>", 2), ("<|im_start|>", 1))),
        "fixedlength-bert": lambda: bytelevel_bpe(
            seq([pre_tokenizers.FixedLength(3), bl()]),
            post=processors.BertProcessing(("<|im_end|>", 2), ("<|im_start|>", 1))),
        "metaspace-replace-regex-decoder": lambda: byte_fallback_bpe(
            pre_tokenizers.Metaspace(prepend_scheme="always", split=True),
            decoders.Sequence([decoders.Replace(Regex("▁+"), " "), decoders.ByteFallback(), decoders.Fuse()])),
    }
    # The tiktoken-converted form: keep the regex's matches, drop the rest.
    out["split-tiktoken-removed-invert"] = lambda: bytelevel_bpe(seq([
        pre_tokenizers.Split(Regex(TIKTOKEN), behavior="removed", invert=True), bl()]))
    for beh in BEHAVIORS:
        for invert in (False, True):
            out[f"split-{beh}{'-invert' if invert else ''}"] = (
                lambda beh=beh, invert=invert: bytelevel_bpe(seq([
                    pre_tokenizers.Split(Regex(PARTIAL), behavior=beh, invert=invert), bl()])))
    return out


def ours(tok_path, lines, tmp, decode=False, special=False):
    path = os.path.join(tmp, "in.txt")
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((",".join(map(str, line)) if decode else json.dumps(line)) + "\n")
    args = [tokenize_bin, "--tokenizer", tok_path, "--file", path] + (["--decode"] if decode else ["--jsonl"])
    args += ["--add-special-tokens"] if special else []
    p = subprocess.run(args, capture_output=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}")
    rows = [json.loads(r) for r in p.stdout.decode().split("\n") if r]
    return [r["text"] if decode else r["ids"] for r in rows]


def mismatches(name, got, want, strings, report):
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b] + list(range(min(len(got), len(want)),
                                                                              max(len(got), len(want))))
    for i in bad[:2]:
        if report is not None:
            g = got[i] if i < len(got) else None
            w = want[i] if i < len(want) else None
            report.append(f"{name}: {strings[i]!r}\n  ours {str(g)[:200]}\n  want {str(w)[:200]}")
    return len(bad)


failures = []
strings = random_strings(n_strings, SEED + 2)
with tempfile.TemporaryDirectory() as tmp:
    total = 0
    by_behavior = {}
    for name, make in configurations().items():
        hf = make()
        path = os.path.join(tmp, name + ".json")
        hf.save(path)
        want = [e.ids for e in hf.encode_batch(strings, add_special_tokens=False)]
        if not any(want[1:]):
            failures.append(f"{name}: HF encodes every string to nothing; the configuration tests nothing")
        got = ours(path, strings, tmp)
        n_enc = mismatches(name + " encode", got, want, strings, failures)
        if hf.post_processor is not None:  # the post-processor's framing, add_special_tokens=True
            want_special = [e.ids for e in hf.encode_batch(strings, add_special_tokens=True)]
            n_enc += mismatches(name + " encode (special)", ours(path, strings, tmp, special=True), want_special,
                                strings, failures)
        want_text = hf.decode_batch(want, skip_special_tokens=False)
        got_text = ours(path, want, tmp, decode=True)
        n_dec = mismatches(name + " decode", got_text, want_text, strings, failures)
        total += len(strings)
        print(f"{name}: {len(strings)} strings, {n_enc} encode and {n_dec} decode mismatches")

        if name == "split-tiktoken-removed-invert":
            # The tiktoken-converted form keeps the matches: it never encodes a non-blank string to [].
            empty = sum(1 for s, ids in zip(strings, got) if s.strip() and not ids)
            if empty:
                failures.append(f"{name}: {empty} non-blank strings encoded to []")
            # One id changed in the expectation: the comparison reports it.
            wrong = [list(ids) for ids in want]
            k = next(i for i, ids in enumerate(wrong) if ids)
            wrong[k][0] = (wrong[k][0] + 1) % hf.get_vocab_size()
            if mismatches("wrong expectation", got, wrong, strings, None) != 1:
                failures.append("a changed id in the expectation was not reported as one mismatch")
        if name in (f"split-{b}" for b in BEHAVIORS):
            by_behavior[name] = want
        if name.startswith("split-") and "isolated" not in name and "contiguous" not in name and "string" not in name:
            # Our copy of the file with invert flipped must disagree with HF (Isolated and Contiguous give the
            # same pieces both ways).
            j = json.loads(hf.to_str())
            j["pre_tokenizer"]["pretokenizers"][0]["invert"] = not j["pre_tokenizer"]["pretokenizers"][0]["invert"]
            flipped = os.path.join(tmp, name + "-flipped.json")
            with open(flipped, "w") as f:
                json.dump(j, f)
            if mismatches(name + " (invert flipped)", ours(flipped, strings, tmp), want, strings, None) == 0:
                failures.append(f"{name}: the file with invert flipped still matches; invert is not read")

    # The pattern tells the behaviors apart: HF's ids differ between every two of them, so reading one
    # behavior as another is a mismatch above.
    names = list(by_behavior)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            if by_behavior[names[a]] == by_behavior[names[b]]:
                failures.append(f"{names[a]} and {names[b]} give the same ids: the test cannot tell them apart")

    # A field the code does not read is refused with its name and the file's, exit 2.
    base = json.loads(configurations()["bytelevel-regex"]().to_str())
    for label, mutate, fragment in (
            ("unknown field", lambda j: j["pre_tokenizer"].__setitem__("colour", "red"), "colour"),
            ("unsupported pre-tokenizer", lambda j: j.__setitem__("pre_tokenizer", {"type": "UnicodeScripts"}),
             "UnicodeScripts"),
            ("unknown model field", lambda j: j["model"].__setitem__("max_input_chars_per_word", 100),
             "max_input_chars_per_word"),
            ("truncation", lambda j: j.__setitem__("truncation", {"max_length": 8, "strategy": "LongestFirst",
                                                                  "stride": 0, "direction": "Right"}), "truncation")):
        j = json.loads(json.dumps(base))
        mutate(j)
        bad_path = os.path.join(tmp, "refused.json")
        with open(bad_path, "w") as f:
            json.dump(j, f)
        p = subprocess.run([tokenize_bin, "--tokenizer", bad_path, "--text", "hi"], capture_output=True, timeout=60)
        err = p.stderr.decode(errors="replace")
        if p.returncode != 2 or fragment not in err or bad_path not in err:
            failures.append(f"{label}: exit {p.returncode}, stderr {err!r}; want exit 2 naming {fragment!r} and the file")
    print(f"{total} strings over {len(configurations())} configurations")

if failures:
    print("\n".join(failures[:30]))
    sys.exit(1)
print("random-string tokenizer parity: all checks passed")
