// tokenizer.json -> the pipeline the `tokenizers` library runs: added tokens split out of the raw text,
// then per remaining segment normalizer -> pre-tokenizer -> BPE, then the post-processor; decode runs
// the decoder chain over the tokens' strings. Written from the library's documented semantics; the
// parity tests (tests/data/check_hf_tokenizer.py) hold it to the library byte for byte.
#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <unordered_map>

#include "data/dataset.h"

namespace rlt {

namespace {

using Json = nlohmann::json;

// GPT-2's reversible byte <-> printable-character alphabet: bytes that are printable Latin-1 map to
// themselves, the other 68 to U+0100 onwards, in byte order.
struct ByteAlphabet {
  std::string to_char[256];                       // byte -> UTF-8 of its character
  std::unordered_map<uint32_t, uint8_t> to_byte;  // code point -> byte
  ByteAlphabet() {
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? b : next++;
      to_char[b] = utf8(cp);
      to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
  static std::string utf8(uint32_t cp) {
    std::string s;
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
    return s;
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

// Length of the UTF-8 sequence starting at s[i] when it is valid, else 0.
size_t utf8_len(const std::string& s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  }
  return n;
}

// Decodes one UTF-8 character at s[i] (valid, of length n).
uint32_t code_point(const std::string& s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  if (n == 1) return b(0);
  if (n == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (n == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

// The library's lossy UTF-8: each maximal invalid subsequence becomes one U+FFFD.
std::string lossy_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_len(s, i);
    if (n > 0 && !(n == 3 && code_point(s, i, 3) >= 0xD800 && code_point(s, i, 3) <= 0xDFFF) &&
        !(n == 4 && code_point(s, i, 4) > 0x10FFFF) && !(n == 2 && code_point(s, i, 2) < 0x80) &&
        !(n == 3 && code_point(s, i, 3) < 0x800) && !(n == 4 && code_point(s, i, 4) < 0x10000)) {
      out.append(s, i, n);
      i += n;
      continue;
    }
    // Skip the longest prefix of a would-be sequence (Rust's from_utf8_lossy: one U+FFFD per maximal
    // invalid prefix, the W3C/Unicode "substitution of maximal subparts").
    const auto c = static_cast<unsigned char>(s[i]);
    size_t want = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 && c <= 0xF4 ? 4 : 1;
    size_t k = 1;
    if (want > 1 && c >= 0xC2) {
      for (; k < want && i + k < s.size(); ++k) {
        const auto d = static_cast<unsigned char>(s[i + k]);
        unsigned lo = 0x80, hi = 0xBF;
        if (k == 1 && c == 0xE0) lo = 0xA0;
        if (k == 1 && c == 0xED) hi = 0x9F;
        if (k == 1 && c == 0xF0) lo = 0x90;
        if (k == 1 && c == 0xF4) hi = 0x8F;
        if (d < lo || d > hi) break;
      }
    }
    out += "\xEF\xBF\xBD";
    i += k;
  }
  return out;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t i = 0;
  for (size_t j; (j = s.find(from, i)) != std::string::npos; i = j + from.size()) out.append(s, i, j - i) += to;
  return out.append(s, i, std::string::npos);
}

std::string str(const Json& j, const char* key, const std::string& dflt = "") {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : dflt;
}
bool flag(const Json& j, const char* key, bool dflt = false) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : dflt;
}

// A compiled Split / ByteLevel regex: UTF mode with Unicode properties (\p{L}, and \s, \d as Unicode),
// JIT-compiled; invalid UTF-8 never matches instead of failing the call.
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      throw DataError(where + ": regex '" + pattern + "' does not compile at offset " + std::to_string(off) + ": " +
                      reinterpret_cast<char*>(msg));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when JIT is unavailable
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }
  // [begin, end) of every match, left to right, empty matches included, as the library's regex engine
  // (Oniguruma) iterates them: the search resumes at the end of the last match, and an empty match that
  // ends where the last match ended is skipped by stepping one character on.
  std::vector<std::pair<size_t, size_t>> find_all(const std::string& s) const {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t pos = 0;
    bool have_last = false;
    size_t last_end = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, 0, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] == ov[0] && have_last && ov[1] == last_end) {
        pos += pos < s.size() ? std::max<size_t>(1, utf8_len(s, pos)) : 1;
        continue;
      }
      out.emplace_back(ov[0], ov[1]);
      pos = last_end = ov[1];
      have_last = true;
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// GPT-2's pre-tokenizer regex, used by a ByteLevel pre-tokenizer with use_regex.
// The Whitespace pre-tokenizer's \w+|[^\w\s]+ with the library's regex engine's Unicode classes:
// \w is Alphabetic, a mark, a decimal digit, a connector or a joiner (not "½" or "①"), \s is \t-\r,
// U+0085 or a separator (Z).
constexpr const char* kWhitespaceRegex =
    R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}]+|[^\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}\t-\r\x{85}\p{Z}]+)";
constexpr const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Unicode White_Space, the library's char::is_whitespace.
bool is_unicode_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// General category Nd, Nl or No ("½", "²", "Ⅻ" as well as "7"), the library's char::is_numeric.
bool is_numeric(uint32_t c) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_NO;
}

// A piece of text as the library's pattern search sees it: a byte range and whether the pattern matched
// it. The spans of a text cover it, in order; an empty text is one empty span that did not match.
struct Span {
  size_t b, e;
  bool match;
};

std::vector<Span> regex_spans(const std::string& s, const Regex& re) {
  if (s.empty()) return {{0, 0, false}};
  std::vector<Span> out;
  size_t prev = 0;
  for (const auto& [b, e] : re.find_all(s)) {
    if (prev != b) out.push_back({prev, b, false});
    out.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) out.push_back({prev, s.size(), false});
  return out;
}

// Each character for which pred holds is a match of its own; the runs between are one span each. A byte
// that is not UTF-8 never matches.
template <class Pred>
std::vector<Span> char_spans(const std::string& s, Pred pred) {
  if (s.empty()) return {{0, 0, false}};
  std::vector<Span> out;
  size_t last = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_len(s, i);
    const size_t len = n == 0 ? 1 : n;
    if (n > 0 && pred(code_point(s, i, n))) {
      if (last < i) out.push_back({last, i, false});
      out.push_back({i, i + len, true});
      last = i + len;
    }
    i += len;
  }
  if (last < s.size()) out.push_back({last, s.size(), false});
  return out;
}

// What a split does with the matches (the library's SplitDelimiterBehavior).
enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// A pre-token: its text, and whether it starts at the start of the input (Metaspace's "first").
struct Piece {
  std::string text;
  bool first;
};

// Splits piece `x` at `spans` (matches flipped first when invert): Removed drops the matches, Isolated
// keeps each span as a piece, MergedWithPrevious appends a match to the piece before it, MergedWithNext
// prepends it to the piece after it, Contiguous joins neighbouring spans of the same kind. Empty pieces
// are dropped.
void split_spans(const Piece& x, std::vector<Span> spans, Behavior beh, bool invert, std::vector<Piece>& out) {
  if (invert) {
    for (auto& sp : spans) sp.match = !sp.match;
  }
  if (beh == Behavior::Isolated || beh == Behavior::Removed) {  // the spans as they are: no merging
    for (const auto& sp : spans) {
      if (sp.e > sp.b && !(beh == Behavior::Removed && sp.match)) {
        out.push_back({x.text.substr(sp.b, sp.e - sp.b), x.first && sp.b == 0});
      }
    }
    return;
  }
  struct Cut {
    size_t b, e;
    bool remove;
  };
  std::vector<Cut> cuts;
  bool prev = false;
  switch (beh) {
    case Behavior::Removed:
    case Behavior::Isolated:
      break;
    case Behavior::MergedWithPrevious:
      for (const auto& sp : spans) {
        if (sp.match && !prev && !cuts.empty())
          cuts.back().e = sp.e;
        else
          cuts.push_back({sp.b, sp.e, false});
        prev = sp.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !prev && !cuts.empty())
          cuts.back().b = it->b;
        else
          cuts.push_back({it->b, it->e, false});
        prev = it->match;
      }
      std::reverse(cuts.begin(), cuts.end());
      break;
    case Behavior::Contiguous:
      for (const auto& sp : spans) {
        if (sp.match == prev && !cuts.empty())
          cuts.back().e = sp.e;
        else
          cuts.push_back({sp.b, sp.e, false});
        prev = sp.match;
      }
      break;
  }
  for (const auto& c : cuts) {
    if (!c.remove && c.e > c.b) out.push_back({x.text.substr(c.b, c.e - c.b), x.first && c.b == 0});
  }
}

// The one character of a Metaspace replacement / CharDelimiterSplit delimiter (the library's `char`).
uint32_t single_char(const std::string& s, const std::function<void(const std::string&)>& fail) {
  const size_t n = s.empty() ? 0 : utf8_len(s, 0);
  if (n == 0 || n != s.size()) fail("'" + s + "' is not one character");
  return code_point(s, 0, n);
}

// Unicode punctuation (Pc, Pd, Ps, Pe, Pi, Pf, Po) or ASCII punctuation ("$", "+", "^" included), the
// library's notion for Punctuation and BertPreTokenizer.
bool is_punctuation(uint32_t c) {
  if (c < 0x80) return std::ispunct(static_cast<int>(c)) != 0;
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat >= UTF8PROC_CATEGORY_PC && cat <= UTF8PROC_CATEGORY_PO;
}

// One character `c` (UTF-8 `ch`) through a per-character normalizer, appended to `out`:
//   Lowercase: the full lowercase mapping ("İ" is "i" + U+0307);
//   StripAccents: every mark (Mn, Mc, Me) dropped;
//   Nmt: control characters dropped, the line and format characters below read as a space;
//   BertNormalizer's steps: BertClean drops NUL, U+FFFD and Cc/Cf/Co/Cs characters but \t \n \r, and reads
//   whitespace as a space, BertChinese puts spaces around CJK ideographs, StripMn drops Mn marks.
void map_char(const std::string& type, uint32_t c, const std::string& ch, std::string& out) {
  const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  if (type == "BertClean") {
    const bool other = cat == UTF8PROC_CATEGORY_CC || cat == UTF8PROC_CATEGORY_CF || cat == UTF8PROC_CATEGORY_CO ||
                       cat == UTF8PROC_CATEGORY_CS;
    if (c == 0 || c == 0xFFFD || (other && c != '\t' && c != '\n' && c != '\r')) return;
    out += is_unicode_space(c) ? std::string(" ") : ch;
  } else if (type == "BertChinese") {
    const bool cjk = (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
                     (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) ||
                     (c >= 0x2B920 && c <= 0x2CEAF) || (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
    out += cjk ? " " + ch + " " : ch;
  } else if (type == "StripMn") {
    if (cat != UTF8PROC_CATEGORY_MN) out += ch;
  } else if (type == "Lowercase") {
    out += c == 0x130 ? std::string("i\xcc\x87") : ByteAlphabet::utf8(utf8proc_tolower(c));
  } else if (type == "StripAccents") {
    if (cat != UTF8PROC_CATEGORY_MN && cat != UTF8PROC_CATEGORY_MC && cat != UTF8PROC_CATEGORY_ME) out += ch;
  } else if ((c >= 0x01 && c <= 0x08) || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F || c == 0x8F || c == 0x9F) {
    // Nmt: dropped
  } else if (c == 0x09 || c == 0x0A || c == 0x0C || c == 0x0D || c == 0x1680 || (c >= 0x200B && c <= 0x200F) ||
             c == 0x2028 || c == 0x2029 || c == 0x2581 || c == 0xFEFF || c == 0xFFFD) {
    out += ' ';
  } else {
    out += ch;
  }
}

// Every match of `re` (empty ones included) replaced by `to`; without a regex, every occurrence of the
// literal `from`, left to right.
std::string replace_pattern(std::string s, const Regex* re, const std::string& from, const std::string& to) {
  if (re == nullptr) return replace_all(std::move(s), from, to);
  std::string out;
  for (const auto& sp : regex_spans(s, *re)) {
    if (sp.match)
      out += to;
    else
      out.append(s, sp.b, sp.e - sp.b);
  }
  return out;
}

// A literal as a PCRE2 pattern: ASCII punctuation escaped, control bytes as \x{..}.
std::string quote_regex(const std::string& lit) {
  std::string out;
  for (unsigned char c : lit) {
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x{%02X}", c);
      out += buf;
    } else if (c < 0x80 && !std::isalnum(c)) {
      out += '\\';
      out += static_cast<char>(c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

}  // namespace

struct HfTokenizer::Impl {
  std::string path;

  // --- model: BPE
  std::unordered_map<std::string, int32_t> vocab;                    // base vocabulary and added tokens
  std::vector<std::string> id_to_token;                              // (V)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a << 32 | b) -> (rank, merged id)
  bool ignore_merges = false, byte_fallback = false, fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_ids[256];  // <0xXX> pieces (byte_fallback), -1 when absent

  // --- normalizer
  struct Normalizer {
    std::string type, a, b;
    std::shared_ptr<Regex> regex;  // Replace with a Regex pattern
  };
  std::vector<Normalizer> normalizers;

  // --- pre-tokenizer
  struct PreTokenizer {
    std::string type;  // Split | ByteLevel | Metaspace | Digits | WhitespaceSplit | CharDelimiterSplit
    std::shared_ptr<Regex> regex;
    Behavior behavior = Behavior::Isolated;
    bool invert = false, add_prefix_space = false, individual_digits = false, split = true;
    std::string replacement, prepend_scheme;
    uint32_t ch = 0;     // Metaspace's replacement, CharDelimiterSplit's delimiter
    int64_t length = 0;  // FixedLength
  };
  std::vector<PreTokenizer> pre_tokenizers;

  // --- added tokens, matched longest first
  struct Added {
    std::string content;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
  };
  std::vector<Added> added;
  // added's indices by [normalized][the token's first byte], longest first: a text position is only
  // compared with the tokens that can start there (Mistral v0.3 has 771 added tokens, Llama-3.1 256).
  // Tokens with normalized=false are matched in the raw text, the others in the normalized text between
  // them, as the library's added vocabulary does.
  std::array<std::array<std::vector<uint32_t>, 256>, 2> added_by_byte;
  bool has_added[2] = {false, false};

  // --- post-processor (single sequences)
  std::vector<int64_t> prefix, suffix;

  // --- decoder
  struct Decoder {
    std::string type, a, b;
    int64_t start = 0, stop = 0;
    std::string prepend_scheme;
    std::shared_ptr<Regex> regex;  // Replace with a Regex pattern
  };
  std::vector<Decoder> decoders;

  // pre-token -> ids, in shards of their own lock by the pre-token's hash: threads encoding at once (a
  // reward model's batch on every core) would otherwise queue on one lock for every pre-token.
  struct CacheShard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>> ids;
  };
  static constexpr size_t kCacheShards = 64;
  mutable std::array<CacheShard, kCacheShards> cache;

  [[noreturn]] void fail(const std::string& what) const { throw DataError(path + ": " + what); }

  // Fails naming the first field of `j` outside `known`: a field this file sets and the code would not
  // read is refused rather than ignored.
  void check_fields(const Json& j, const std::string& where, std::initializer_list<const char*> known) const {
    if (!j.is_object()) fail(where + ": not an object");
    for (const auto& [key, value] : j.items()) {
      if (std::none_of(known.begin(), known.end(), [&](const char* k) { return key == k; })) {
        fail(where + ": field '" + key + "' is not supported");
      }
    }
  }

  void load_model(const Json& m) {
    if (str(m, "type") != "BPE") fail("model.type '" + str(m, "type") + "' is not supported (BPE only)");
    check_fields(m, "model (BPE)",
                 {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                  "byte_fallback", "ignore_merges", "vocab", "merges"});
    if (!str(m, "continuing_subword_prefix").empty() || !str(m, "end_of_word_suffix").empty()) {
      fail("model: continuing_subword_prefix / end_of_word_suffix are not supported");
    }
    if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0) {
      fail("model.dropout: BPE dropout is not supported");
    }
    ignore_merges = flag(m, "ignore_merges");
    byte_fallback = flag(m, "byte_fallback");
    fuse_unk = flag(m, "fuse_unk");
    if (!m.contains("vocab") || !m["vocab"].is_object()) fail("model.vocab: missing or not an object");
    int32_t max_id = -1;
    for (const auto& [tok, id] : m["vocab"].items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        fail("model.vocab['" + tok + "']: not a token id");
      }
      vocab[tok] = id.get<int32_t>();
      max_id = std::max(max_id, id.get<int32_t>());
    }
    id_to_token.assign(max_id + 1, "");
    for (const auto& [tok, id] : vocab) id_to_token[id] = tok;
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      auto it = vocab.find(m["unk_token"].get<std::string>());
      if (it != vocab.end()) unk_id = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      auto it = vocab.find(name);
      byte_ids[b] = it == vocab.end() ? -1 : it->second;
    }
    if (!m.contains("merges") || !m["merges"].is_array()) fail("model.merges: missing or not a list");
    int32_t rank = 0;
    for (const auto& mg : m["merges"]) {
      std::string a, b;
      if (mg.is_string()) {  // "a b"
        const std::string s = mg.get<std::string>();
        const auto sp = s.find(' ', 1);
        if (sp == std::string::npos) fail("model.merges[" + std::to_string(rank) + "]: '" + s + "' is not 'a b'");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {  // ["a", "b"]
        a = mg[0].get<std::string>();
        b = mg[1].get<std::string>();
      } else {
        fail("model.merges[" + std::to_string(rank) + "]: neither 'a b' nor [\"a\", \"b\"]");
      }
      auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
      if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end()) {
        fail("model.merges[" + std::to_string(rank) + "]: '" + a + "' + '" + b + "' is not in the vocabulary");
      }
      const uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
      merges.emplace(key, std::make_pair(rank, iab->second));  // the first (lowest) rank wins
      ++rank;
    }
  }

  void load_normalizer(const Json& n) {
    if (n.is_null()) return;
    const std::string type = str(n, "type");
    const std::string where = "normalizer " + type;
    if (type == "Sequence") {
      check_fields(n, where, {"type", "normalizers"});
      for (const auto& x : n["normalizers"]) load_normalizer(x);
    } else if (type == "NFC" || type == "NFKC" || type == "NFD" || type == "NFKD" || type == "Lowercase" ||
               type == "StripAccents" || type == "Nmt" || type == "ByteLevel") {
      check_fields(n, where, {"type"});
      normalizers.push_back({type, "", ""});
    } else if (type == "BertNormalizer") {  // as its steps, in the library's order
      check_fields(n, where, {"type", "clean_text", "handle_chinese_chars", "strip_accents", "lowercase"});
      const bool lowercase = flag(n, "lowercase", true);
      if (flag(n, "clean_text", true)) normalizers.push_back({"BertClean", "", ""});
      if (flag(n, "handle_chinese_chars", true)) normalizers.push_back({"BertChinese", "", ""});
      if (flag(n, "strip_accents", lowercase)) {
        normalizers.push_back({"NFD", "", ""});
        normalizers.push_back({"StripMn", "", ""});
      }
      if (lowercase) normalizers.push_back({"Lowercase", "", ""});
    } else if (type == "Strip") {
      check_fields(n, where, {"type", "strip_left", "strip_right"});
      normalizers.push_back({type, flag(n, "strip_left") ? "l" : "", flag(n, "strip_right") ? "r" : ""});
    } else if (type == "Prepend") {
      check_fields(n, where, {"type", "prepend"});
      normalizers.push_back({type, str(n, "prepend"), ""});
    } else if (type == "Replace") {
      check_fields(n, where, {"type", "pattern", "content"});
      Normalizer x{type, "", str(n, "content"), nullptr};
      load_pattern(n, where, x.a, x.regex);
      normalizers.push_back(std::move(x));
    } else {
      fail("normalizer '" + type + "' is not supported");
    }
  }

  // A Replace's pattern: {"String": literal} (every occurrence, left to right) or {"Regex": ...}.
  void load_pattern(const Json& j, const std::string& where, std::string& literal,
                    std::shared_ptr<Regex>& regex) const {
    const Json pat = j.value("pattern", Json());
    if (pat.is_object() && pat.contains("String") && !pat["String"].get<std::string>().empty()) {
      literal = pat["String"].get<std::string>();
    } else if (pat.is_object() && pat.contains("Regex")) {
      regex = std::make_shared<Regex>(pat["Regex"].get<std::string>(), path + ": " + where);
    } else {
      fail(where + ": pattern is neither Regex nor a non-empty String");
    }
  }

  void load_pre_tokenizer(const Json& p) {
    if (p.is_null()) return;
    const std::string type = str(p, "type");
    const std::string where = "pre_tokenizer " + type;
    PreTokenizer t;
    t.type = type;
    if (type == "Sequence") {
      check_fields(p, where, {"type", "pretokenizers"});
      for (const auto& x : p["pretokenizers"]) load_pre_tokenizer(x);
      return;
    } else if (type == "Split") {
      check_fields(p, where, {"type", "pattern", "behavior", "invert"});
      if (!p.contains("pattern")) fail("pre_tokenizer Split: no pattern");
      const Json& pat = p["pattern"];
      std::string re;
      if (pat.contains("Regex")) {
        re = pat["Regex"].get<std::string>();
      } else if (pat.contains("String") && !pat["String"].get<std::string>().empty()) {
        re = quote_regex(pat["String"].get<std::string>());
      } else {
        fail("pre_tokenizer Split: pattern is neither Regex nor a non-empty String");
      }
      t.regex = std::make_shared<Regex>(re, path + ": pre_tokenizer Split");
      t.behavior = behavior(str(p, "behavior", "Isolated"), where);
      t.invert = flag(p, "invert");
    } else if (type == "ByteLevel") {
      // trim_offsets moves offsets only, which encode does not return.
      check_fields(p, where, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
      t.add_prefix_space = flag(p, "add_prefix_space");
      if (flag(p, "use_regex", true)) t.regex = std::make_shared<Regex>(kGpt2Regex, path + ": ByteLevel");
    } else if (type == "Metaspace") {
      // str_rep: older files' copy of replacement.
      check_fields(p, where, {"type", "replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"});
      t.replacement = str(p, "replacement", "\xe2\x96\x81");
      t.ch = single_char(t.replacement, [&](const std::string& m) { fail(where + " replacement: " + m); });
      t.prepend_scheme = str(p, "prepend_scheme", flag(p, "add_prefix_space", true) ? "always" : "never");
      if (t.prepend_scheme != "always" && t.prepend_scheme != "first" && t.prepend_scheme != "never") {
        fail(where + ": prepend_scheme '" + t.prepend_scheme + "' is not always, first or never");
      }
      t.split = flag(p, "split", true);
    } else if (type == "Digits") {
      check_fields(p, where, {"type", "individual_digits"});
      t.individual_digits = flag(p, "individual_digits");
    } else if (type == "WhitespaceSplit") {
      check_fields(p, where, {"type"});
    } else if (type == "Punctuation") {
      check_fields(p, where, {"type", "behavior"});
      t.behavior = behavior(str(p, "behavior", "Isolated"), where);
    } else if (type == "Whitespace") {  // keeps the regex's matches
      check_fields(p, where, {"type"});
      t.type = "Split";
      t.regex = std::make_shared<Regex>(kWhitespaceRegex, path + ": Whitespace");
      t.behavior = Behavior::Removed;
      t.invert = true;
    } else if (type == "BertPreTokenizer") {
      check_fields(p, where, {"type"});
    } else if (type == "FixedLength") {
      check_fields(p, where, {"type", "length"});
      t.length = p.value("length", int64_t{5});
      if (t.length <= 0) fail(where + ": length " + std::to_string(t.length) + " is not positive");
    } else if (type == "CharDelimiterSplit") {
      check_fields(p, where, {"type", "delimiter"});
      t.ch = single_char(str(p, "delimiter"), [&](const std::string& m) { fail(where + " delimiter: " + m); });
    } else {
      fail("pre_tokenizer '" + type + "' is not supported");
    }
    pre_tokenizers.push_back(std::move(t));
  }

  Behavior behavior(const std::string& name, const std::string& where) const {
    if (name == "Removed") return Behavior::Removed;
    if (name == "Isolated") return Behavior::Isolated;
    if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
    if (name == "MergedWithNext") return Behavior::MergedWithNext;
    if (name == "Contiguous") return Behavior::Contiguous;
    fail(where + ": behavior '" + name + "' is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, " +
         "Contiguous");
  }

  int64_t special_id(const std::string& token, const std::string& where) const {
    auto it = vocab.find(token);
    if (it == vocab.end()) fail(where + ": special token '" + token + "' is not in the vocabulary");
    return it->second;
  }

  void load_post_processor(const Json& p) {
    if (p.is_null()) return;
    const std::string type = str(p, "type");
    const std::string where = "post_processor " + type;
    if (type == "Sequence") {
      check_fields(p, where, {"type", "processors"});
      for (const auto& x : p["processors"]) load_post_processor(x);
    } else if (type == "ByteLevel") {  // offsets only, which encode does not return
      check_fields(p, where, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
    } else if (type == "BertProcessing" || type == "RobertaProcessing") {  // cls A sep
      if (type == "BertProcessing")
        check_fields(p, where, {"type", "sep", "cls"});
      else  // trim_offsets, add_prefix_space: offsets only
        check_fields(p, where, {"type", "sep", "cls", "trim_offsets", "add_prefix_space"});
      for (const char* k : {"cls", "sep"}) {
        if (!p.contains(k) || !p[k].is_array() || p[k].size() != 2 || !p[k][1].is_number_integer()) {
          fail(where + ": " + k + " is not [token, id]");
        }
      }
      prefix.push_back(p["cls"][1].get<int64_t>());
      suffix.insert(suffix.begin(), p["sep"][1].get<int64_t>());
    } else if (type == "TemplateProcessing") {
      // pair frames two sequences, which encode does not take; type ids are not returned.
      check_fields(p, where, {"type", "single", "pair", "special_tokens"});
      bool seen_a = false;
      for (const auto& item : p["single"]) {
        if (item.contains("Sequence")) {
          seen_a = true;
        } else if (item.contains("SpecialToken")) {
          const std::string name = item["SpecialToken"]["id"].get<std::string>();
          std::vector<int64_t> ids;
          if (p.contains("special_tokens") && p["special_tokens"].contains(name)) {
            for (const auto& id : p["special_tokens"][name]["ids"]) ids.push_back(id.get<int64_t>());
          } else {
            ids.push_back(special_id(name, "post_processor"));
          }
          auto& dst = seen_a ? suffix : prefix;
          dst.insert(dst.end(), ids.begin(), ids.end());
        }
      }
    } else {
      fail("post_processor '" + type + "' is not supported");
    }
  }

  void load_decoder(const Json& d) {
    if (d.is_null()) return;
    const std::string type = str(d, "type");
    const std::string where = "decoder " + type;
    Decoder x;
    x.type = type;
    if (type == "Sequence") {
      check_fields(d, where, {"type", "decoders"});
      for (const auto& y : d["decoders"]) load_decoder(y);
      return;
    } else if (type == "Replace") {
      check_fields(d, where, {"type", "pattern", "content"});
      load_pattern(d, where, x.a, x.regex);
      x.b = str(d, "content");
    } else if (type == "Strip") {
      check_fields(d, where, {"type", "content", "start", "stop"});
      x.a = str(d, "content", " ");
      single_char(x.a, [&](const std::string& m) { fail(where + " content: " + m); });
      x.start = d.value("start", 0);
      x.stop = d.value("stop", 0);
    } else if (type == "Metaspace") {
      // split only shapes encoding; str_rep is older files' copy of replacement.
      check_fields(d, where, {"type", "replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"});
      x.a = str(d, "replacement", "\xe2\x96\x81");
      single_char(x.a, [&](const std::string& m) { fail(where + " replacement: " + m); });
      x.prepend_scheme = str(d, "prepend_scheme", flag(d, "add_prefix_space", true) ? "always" : "never");
    } else if (type == "ByteLevel") {  // the library's ByteLevel decoder reads none of its fields
      check_fields(d, where, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
    } else if (type == "ByteFallback" || type == "Fuse") {
      check_fields(d, where, {"type"});
    } else {
      fail("decoder '" + type + "' is not supported");
    }
    decoders.push_back(std::move(x));
  }

  void load_added(const Json& list) {
    for (const auto& a : list) {
      check_fields(a, "added_tokens", {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
      Added t{a.at("content").get<std::string>(),
              a.at("id").get<int32_t>(),
              flag(a, "special"),
              flag(a, "lstrip"),
              flag(a, "rstrip"),
              flag(a, "single_word"),
              flag(a, "normalized", !flag(a, "special"))};
      if (t.content.empty()) fail("added_tokens: an empty token (id " + std::to_string(t.id) + ")");
      // A normalized token is matched, and decodes, as the normalizer writes it ("ﬁnAl" under NFKC and
      // Lowercase is "final"), as the library does.
      if (t.normalized) {
        vocab[t.content] = t.id;
        t.content = normalize(t.content);
        if (t.content.empty()) fail("added_tokens: token id " + std::to_string(t.id) + " normalizes to nothing");
      }
      if (t.id >= static_cast<int32_t>(id_to_token.size())) id_to_token.resize(t.id + 1);
      id_to_token[t.id] = t.content;
      vocab[t.content] = t.id;
      added.push_back(t);
    }
    std::stable_sort(added.begin(), added.end(),
                     [](const Added& x, const Added& y) { return x.content.size() > y.content.size(); });
    for (uint32_t k = 0; k < added.size(); ++k) {
      added_by_byte[added[k].normalized][static_cast<unsigned char>(added[k].content[0])].push_back(k);
      has_added[added[k].normalized] = true;
    }
  }

  // ---------------------------------------------------------------- encode

  struct Segment {
    std::string text;
    size_t offset;    // where it starts in the input
    int32_t id = -1;  // an added token, else -1
  };

  // The character ending at s[i] (its start in *start), or -1 when the bytes before i are not UTF-8.
  static int64_t char_before(const std::string& s, size_t i, size_t* start) {
    size_t k = i - 1;
    while (k > 0 && i - k < 4 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    const size_t n = utf8_len(s, k);
    *start = k;
    return n == i - k ? static_cast<int64_t>(code_point(s, k, n)) : -1;
  }
  static int64_t char_at(const std::string& s, size_t i, size_t* len) {
    const size_t n = utf8_len(s, i);
    *len = n == 0 ? 1 : n;
    return n == 0 ? -1 : static_cast<int64_t>(code_point(s, i, n));
  }
  // A word character for single_word: alphanumeric (letters and numerics) or '_'.
  static bool is_word_char(int64_t c) {
    if (c < 0) return false;
    if (c == '_' || is_numeric(static_cast<uint32_t>(c))) return true;
    const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
    return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
  }

  // Added tokens out of the raw text: at each position the longest token that matches (leftmost first);
  // lstrip / rstrip tokens take the whitespace beside them.
  std::vector<Segment> split_added(const std::string& text, bool normalized) const {
    if (!has_added[normalized]) return {{text, 0, -1}};
    std::vector<Segment> out;
    size_t start = 0, i = 0;
    while (i < text.size()) {
      const Added* hit = nullptr;
      for (uint32_t k : added_by_byte[normalized][static_cast<unsigned char>(text[i])]) {
        const Added& a = added[k];
        if (text.compare(i, a.content.size(), a.content) != 0) continue;
        if (a.single_word) {
          const size_t e = i + a.content.size();
          size_t at = 0;
          const bool left_ok = i == 0 || !is_word_char(char_before(text, i, &at));
          const bool right_ok = e == text.size() || !is_word_char(char_at(text, e, &at));
          if (!left_ok || !right_ok) continue;
        }
        hit = &a;
        break;  // sorted longest first
      }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      size_t b = i, e = i + hit->content.size();
      size_t at = 0;  // lstrip / rstrip take the Unicode whitespace beside the token
      if (hit->lstrip) {
        for (int64_t c;
             b > start && (c = char_before(text, b, &at)) >= 0 && is_unicode_space(static_cast<uint32_t>(c));)
          b = at;
      }
      if (hit->rstrip) {
        size_t len = 0;
        for (int64_t c;
             e < text.size() && (c = char_at(text, e, &len)) >= 0 && is_unicode_space(static_cast<uint32_t>(c));) {
          e += len;
        }
      }
      if (b > start) out.push_back({text.substr(start, b - start), start, -1});
      out.push_back({text.substr(b, e - b), b, hit->id});
      start = i = e;
    }
    if (start < text.size()) out.push_back({text.substr(start), start, -1});
    return out;
  }

  std::string normalize(std::string s) const {
    for (const auto& n : normalizers) {
      if (n.type == "Prepend") {
        if (!s.empty()) s = n.a + s;
      } else if (n.type == "Lowercase" || n.type == "StripAccents" || n.type == "Nmt" || n.type == "BertClean" ||
                 n.type == "BertChinese" || n.type == "StripMn") {  // char by char
        std::string out;
        for (size_t i = 0; i < s.size();) {
          const size_t len = utf8_len(s, i);
          if (len == 0) {
            out += s[i++];
            continue;
          }
          map_char(n.type, code_point(s, i, len), s.substr(i, len), out);
          i += len;
        }
        s.swap(out);
      } else if (n.type == "Strip") {  // Unicode whitespace off either end
        size_t b = 0, e = s.size();
        while (!n.a.empty() && b < e) {
          const size_t len = utf8_len(s, b);
          if (len == 0 || !is_unicode_space(code_point(s, b, len))) break;
          b += len;
        }
        while (!n.b.empty() && e > b) {
          size_t k = e - 1;
          while (k > b && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
          const size_t len = utf8_len(s, k);
          if (len != e - k || !is_unicode_space(code_point(s, k, len))) break;
          e = k;
        }
        s = s.substr(b, e - b);
      } else if (n.type == "Replace") {
        s = replace_pattern(std::move(s), n.regex.get(), n.a, n.b);
      } else if (n.type == "ByteLevel") {  // each byte as its byte-level alphabet character
        std::string out;
        for (unsigned char c : s) out += alphabet().to_char[c];
        s.swap(out);
      } else {
        int opts = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
        if (n.type == "NFKC") opts |= UTF8PROC_COMPAT;
        if (n.type == "NFD") opts = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
        if (n.type == "NFKD") opts = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
        utf8proc_uint8_t* out = nullptr;
        const auto len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), s.size(), &out,
                                      static_cast<utf8proc_option_t>(opts));
        if (len >= 0) s.assign(reinterpret_cast<char*>(out), len);  // invalid UTF-8: left as it is
        std::free(out);
      }
    }
    return s;
  }

  std::vector<std::string> pre_tokenize(const std::string& s, bool at_input_start) const {
    std::vector<Piece> pieces;
    if (!s.empty()) pieces.push_back({s, at_input_start});
    for (const auto& p : pre_tokenizers) {
      std::vector<Piece> next;
      for (const Piece& x : pieces) {
        if (p.type == "Split") {
          split_spans(x, regex_spans(x.text, *p.regex), p.behavior, p.invert, next);
        } else if (p.type == "ByteLevel") {
          const size_t from = next.size();
          Piece prefixed;
          const Piece* y = &x;
          if (p.add_prefix_space && x.text[0] != ' ') {
            prefixed = {" " + x.text, x.first};
            y = &prefixed;
          }
          if (p.regex)
            split_spans(*y, regex_spans(y->text, *p.regex), Behavior::Isolated, false, next);
          else
            next.push_back(*y);
          for (size_t k = from; k < next.size(); ++k) {
            std::string mapped;
            for (unsigned char c : next[k].text) mapped += alphabet().to_char[c];
            next[k].text.swap(mapped);
          }
        } else if (p.type == "Metaspace") {
          Piece y{replace_all(x.text, " ", p.replacement), x.first};
          const bool prepend = p.prepend_scheme == "always" || (p.prepend_scheme == "first" && x.first);
          if (prepend && y.text.compare(0, p.replacement.size(), p.replacement) != 0) y.text = p.replacement + y.text;
          if (!p.split) {
            next.push_back(std::move(y));
            continue;
          }
          split_spans(y, char_spans(y.text, [&](uint32_t c) { return c == p.ch; }), Behavior::MergedWithNext, false,
                      next);
        } else if (p.type == "Digits") {
          split_spans(x, char_spans(x.text, is_numeric),
                      p.individual_digits ? Behavior::Isolated : Behavior::Contiguous, false, next);
        } else if (p.type == "WhitespaceSplit") {
          split_spans(x, char_spans(x.text, is_unicode_space), Behavior::Removed, false, next);
        } else if (p.type == "CharDelimiterSplit") {
          split_spans(x, char_spans(x.text, [&](uint32_t c) { return c == p.ch; }), Behavior::Removed, false, next);
        } else if (p.type == "Punctuation") {
          split_spans(x, char_spans(x.text, is_punctuation), p.behavior, false, next);
        } else if (p.type == "BertPreTokenizer") {
          std::vector<Piece> words;
          split_spans(x, char_spans(x.text, is_unicode_space), Behavior::Removed, false, words);
          for (const auto& w : words)
            split_spans(w, char_spans(w.text, is_punctuation), Behavior::Isolated, false, next);
        } else if (p.type == "FixedLength") {  // chunks of `length` characters
          size_t b = 0, n = 0;
          for (size_t i = 0; i <= x.text.size();) {
            if (i == x.text.size() || n == static_cast<size_t>(p.length)) {
              if (i > b) next.push_back({x.text.substr(b, i - b), x.first && b == 0});
              b = i;
              n = 0;
              if (i == x.text.size()) break;
            }
            const size_t len = utf8_len(x.text, i);
            i += len == 0 ? 1 : len;
            ++n;
          }
        }
      }
      pieces.swap(next);
    }
    std::vector<std::string> out;
    out.reserve(pieces.size());
    for (auto& x : pieces) out.push_back(std::move(x.text));
    return out;
  }

  // Applies the merges to a word's symbols: the lowest rank first, among equal ranks the leftmost. A heap
  // of candidate pairs over a linked list of symbols: O(n log n) in the symbols, where rescanning the word
  // after every merge is O(n^2) (a Metaspace line without splitting, as Mistral's, is one long word).
  void merge(std::vector<int32_t>& ids) const {
    const int n = static_cast<int>(ids.size());
    if (n < 2) return;
    std::vector<int> prev(n), next(n);
    for (int k = 0; k < n; ++k) prev[k] = k - 1, next[k] = k + 1 < n ? k + 1 : -1;
    struct Cand {
      int32_t rank;
      int pos;  // the left symbol's index: symbols keep their left end, so it orders them left to right
      int32_t left, right, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](int a) {
      if (a < 0 || next[a] < 0) return;
      auto it = merges.find((static_cast<uint64_t>(ids[a]) << 32) | static_cast<uint32_t>(ids[next[a]]));
      if (it != merges.end()) heap.push({it->second.first, a, ids[a], ids[next[a]], it->second.second});
    };
    for (int k = 0; k + 1 < n; ++k) push(k);
    std::vector<uint8_t> dead(n, 0);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      const int b = next[c.pos];
      // Stale: a symbol of the pair was merged away or changed since the candidate was pushed.
      if (dead[c.pos] || b < 0 || ids[c.pos] != c.left || ids[b] != c.right) continue;
      ids[c.pos] = c.merged;
      dead[b] = 1;
      next[c.pos] = next[b];
      if (next[b] >= 0) prev[next[b]] = c.pos;
      push(prev[c.pos]);
      push(c.pos);
    }
    int w = 0;
    for (int k = 0; k < n; ++k) {
      if (!dead[k]) ids[w++] = ids[k];
    }
    ids.resize(w);
  }

  // One pre-token through the BPE model (cached).
  void bpe(const std::string& word, std::vector<int64_t>& out) const {
    CacheShard& shard = cache[std::hash<std::string>{}(word) % kCacheShards];
    {
      std::lock_guard<std::mutex> lock(shard.mu);
      auto it = shard.ids.find(word);
      if (it != shard.ids.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> ids;
    auto whole = vocab.find(word);
    if (ignore_merges && whole != vocab.end()) {
      ids.push_back(whole->second);
    } else {
      // Symbols: one per character, or its <0xXX> bytes, or unk.
      for (size_t i = 0; i < word.size();) {
        size_t n = utf8_len(word, i);
        if (n == 0) n = 1;
        auto it = vocab.find(word.substr(i, n));
        if (it != vocab.end()) {
          ids.push_back(it->second);
        } else if (byte_fallback && std::all_of(word.begin() + i, word.begin() + i + n,
                                                [&](char c) { return byte_ids[static_cast<unsigned char>(c)] >= 0; })) {
          for (size_t k = 0; k < n; ++k) ids.push_back(byte_ids[static_cast<unsigned char>(word[i + k])]);
        } else if (unk_id >= 0) {
          if (!(fuse_unk && !ids.empty() && ids.back() == unk_id)) ids.push_back(unk_id);
        }
        i += n;
      }
      merge(ids);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    std::lock_guard<std::mutex> lock(shard.mu);
    // Bounded (200,000 pre-tokens in all): a long run never grows it without end.
    if (shard.ids.size() > 200000 / kCacheShards) shard.ids.clear();
    shard.ids.emplace(word, std::move(ids));
  }

  // ---------------------------------------------------------------- decode

  // The decoder chain over token strings. exact: one token's own bytes (no lossy UTF-8, no Strip).
  std::string run_decoders(std::vector<std::string> toks, bool exact) const {
    if (decoders.empty()) {
      std::string s;
      for (size_t i = 0; i < toks.size(); ++i) s += (i ? " " : "") + toks[i];  // the library joins with spaces
      return exact ? s : lossy_utf8(s);
    }
    for (const auto& d : decoders) {
      if (d.type == "ByteLevel") {
        // A token whose characters are all in the alphabet becomes their bytes; any other token (an added
        // token such as "ﬁnal") stays as its own UTF-8, whole.
        std::string bytes;
        for (const auto& t : toks) {
          std::string mapped;
          bool all = true;
          for (size_t i = 0; i < t.size() && all;) {
            const size_t n = utf8_len(t, i);
            auto it = n == 0 ? alphabet().to_byte.end() : alphabet().to_byte.find(code_point(t, i, n));
            all = it != alphabet().to_byte.end();
            if (all) mapped += static_cast<char>(it->second);
            i += n == 0 ? 1 : n;
          }
          bytes += all ? mapped : t;
        }
        toks = {exact ? bytes : lossy_utf8(bytes)};
      } else if (d.type == "Replace") {
        for (auto& t : toks) t = replace_pattern(t, d.regex.get(), d.a, d.b);
      } else if (d.type == "ByteFallback") {
        std::vector<std::string> next;
        std::string pending;  // consecutive <0xXX> bytes
        size_t pending_n = 0;
        auto flush = [&] {
          if (pending_n == 0) return;
          if (exact) {
            next.push_back(pending);
          } else {
            bool valid = true;
            for (size_t i = 0; i < pending.size();) {
              const size_t n = utf8_len(pending, i);
              if (n == 0) {
                valid = false;
                break;
              }
              i += n;
            }
            std::string repl;
            for (size_t i = 0; i < pending_n; ++i) repl += "\xEF\xBF\xBD";
            next.push_back(valid ? pending : repl);
          }
          pending.clear();
          pending_n = 0;
        };
        for (const auto& t : toks) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(t[3]) &&
              std::isxdigit(t[4])) {
            pending += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
            ++pending_n;
          } else {
            flush();
            next.push_back(t);
          }
        }
        flush();
        toks.swap(next);
      } else if (d.type == "Fuse") {
        std::string s;
        for (const auto& t : toks) s += t;
        toks = {s};
      } else if (d.type == "Strip") {
        if (exact) continue;
        for (auto& t : toks) {
          for (int64_t k = 0; k < d.start && t.compare(0, d.a.size(), d.a) == 0; ++k) t.erase(0, d.a.size());
          for (int64_t k = 0;
               k < d.stop && t.size() >= d.a.size() && t.compare(t.size() - d.a.size(), d.a.size(), d.a) == 0; ++k) {
            t.erase(t.size() - d.a.size());
          }
        }
      } else if (d.type == "Metaspace") {
        // Every replacement becomes a space, except in the first token, where a prepend scheme other than
        // never drops them all (the library's rule, "▁▁a" first decodes to "a").
        for (size_t i = 0; i < toks.size(); ++i) {
          toks[i] = replace_all(toks[i], d.a, !exact && i == 0 && d.prepend_scheme != "never" ? "" : " ");
        }
      }
    }
    std::string s;
    for (const auto& t : toks) s += t;
    return exact ? s : lossy_utf8(s);
  }
};

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

std::shared_ptr<const HfTokenizer> HfTokenizer::load(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw DataError(path + ": cannot open the tokenizer");
  Json j;
  try {
    j = Json::parse(f);
  } catch (const Json::exception& e) {
    throw DataError(path + ": not valid JSON: " + e.what());
  }
  if (!j.is_object() || !j.contains("model")) impl->fail("not a tokenizer.json (no \"model\")");
  try {
    impl->check_fields(j, "tokenizer.json",
                       {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "model",
                        "post_processor", "decoder"});
    // Both change what encode returns; a file that sets them is refused rather than encoded differently.
    for (const char* k : {"truncation", "padding"}) {
      if (j.contains(k) && !j[k].is_null()) impl->fail(std::string(k) + ": set; only null is supported");
    }
    impl->load_model(j["model"]);
    impl->load_normalizer(j.value("normalizer", Json()));  // first: normalized added tokens go through it
    impl->load_added(j.value("added_tokens", Json::array()));
    impl->load_pre_tokenizer(j.value("pre_tokenizer", Json()));
    impl->load_post_processor(j.value("post_processor", Json()));
    impl->load_decoder(j.value("decoder", Json()));
  } catch (const Json::exception& e) {
    impl->fail(std::string("malformed: ") + e.what());
  }
  return std::shared_ptr<const HfTokenizer>(new HfTokenizer(std::move(impl)));
}

std::vector<int64_t> HfTokenizer::encode(const std::string& text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = m.prefix;
  for (const auto& raw : m.split_added(text, /*normalized=*/false)) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    for (const auto& seg : m.split_added(m.normalize(raw.text), /*normalized=*/true)) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      for (const auto& piece : m.pre_tokenize(seg.text, raw.offset == 0 && seg.offset == 0)) m.bpe(piece, ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), m.suffix.begin(), m.suffix.end());
  return ids;
}

std::string HfTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size() || impl_->id_to_token[id].empty()) {
      throw DataError(impl_->path + ": decode: id " + std::to_string(id) + " is not in the vocabulary of " +
                      std::to_string(vocab_size()));
    }
    toks.push_back(impl_->id_to_token[id]);
  }
  return impl_->run_decoders(std::move(toks), /*exact=*/false);
}

std::string HfTokenizer::token_bytes(int64_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  return impl_->run_decoders({impl_->id_to_token[id]}, /*exact=*/true);
}

int64_t HfTokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

int64_t HfTokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

}  // namespace rlt
