// Tests of model/safetensors: bit-exact round trips of every dtype family (incl. NaN payloads, -0.0,
// denormals, a 0-d scalar and zero-size tensors), the exact byte layout and write -> read -> write
// identity, sharding + index, metadata, shape/dtype-checked loads, one Error per corrupt-input case
// (each message must name the file and tensor), and interoperability with the Python `safetensors`
// package when it is installed. CPU only; every test works in its own temporary folder.
#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/common/tmpdir.h"

namespace rlt::safetensors {
namespace {

namespace fs = std::filesystem;
using Named = std::vector<std::pair<std::string, at::Tensor>>;

// ---------------------------------------------------------------------------------------------------------
// Helpers

// From raw bit patterns, so NaN payloads, -0.0 and denormals are exactly what the test says they are.
template <class Bits>
at::Tensor from_bits(const std::vector<Bits>& bits, at::IntArrayRef shape, at::ScalarType dtype) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  EXPECT_EQ(static_cast<size_t>(t.numel()) * t.element_size(), bits.size() * sizeof(Bits));
  std::memcpy(t.data_ptr(), bits.data(), bits.size() * sizeof(Bits));
  return t;
}

// Same dtype, same shape, same bytes. A value comparison would not do: NaN != NaN, and -0.0 == 0.0.
::testing::AssertionResult bit_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (got.scalar_type() != want.scalar_type()) {
    return ::testing::AssertionFailure() << what << ": dtype " << got.scalar_type() << " vs " << want.scalar_type();
  }
  if (got.sizes() != want.sizes()) {
    return ::testing::AssertionFailure() << what << ": shape " << got.sizes() << " vs " << want.sizes();
  }
  const at::Tensor g = got.contiguous(), w = want.contiguous();
  const size_t n = static_cast<size_t>(g.numel()) * g.element_size();
  if (n > 0 && std::memcmp(g.data_ptr(), w.data_ptr(), n) != 0) {
    return ::testing::AssertionFailure() << what << ": bytes differ";
  }
  return ::testing::AssertionSuccess();
}

// Passes when fn throws safetensors::Error whose message contains every one of `parts`.
template <class F>
::testing::AssertionResult throws_error(F&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts) {
      if (msg.find(p) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" does not contain \"" << p << "\"";
      }
    }
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-safetensors::Error exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "no exception thrown";
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return n;
}

std::string u64_bytes(uint64_t n) { return std::string(reinterpret_cast<const char*>(&n), 8); }

// Replaces the first `from` in the file's header by `to` and rewrites the length prefix to match.
void patch_header(const std::string& path, const std::string& from, const std::string& to) {
  const std::string bytes = read_bytes(path);
  const uint64_t n = header_length(bytes);
  std::string header = bytes.substr(8, n);
  const size_t at = header.find(from);
  ASSERT_NE(at, std::string::npos) << "'" << from << "' not in header " << header;
  header.replace(at, from.size(), to);
  write_bytes(path, u64_bytes(header.size()) + header + bytes.substr(8 + n));
}

// Replaces the whole header.
void set_header(const std::string& path, const std::string& header) {
  const std::string bytes = read_bytes(path);
  write_bytes(path, u64_bytes(header.size()) + header + bytes.substr(8 + header_length(bytes)));
}

class SafetensorsTest : public ::testing::Test {
 protected:
  // A fresh folder per test: <tmp>/rlt_safetensors_<test>_<pid>, removed afterwards (tests/common/tmpdir.h
  // says why not std::filesystem::remove_all).
  void SetUp() override {
    tmp_ = std::make_unique<rlt::testing::TempDir>(std::string("safetensors_") +
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    dir_ = tmp_->path();
  }
  void TearDown() override { tmp_.reset(); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // bias F32 (3) at data [0, 12), weight BF16 (2, 3) at [12, 24): distinct dtypes so patches can aim at
  // one entry.
  std::string write_valid(const std::string& name = "valid.safetensors") {
    const std::string file = path(name);
    write_file(file, {{"bias", at::arange(3, at::kFloat)}, {"weight", at::ones({2, 3}, at::kBFloat16)}});
    return file;
  }

  std::unique_ptr<rlt::testing::TempDir> tmp_;
  fs::path dir_;
};

// Every dtype family with its edge values; names sorted, as callers are asked to pass them.
Named edge_tensors() {
  Named t;
  // 1.5, -0.0, +inf, -inf, NaN with payload 0x123, smallest denormal.
  t.emplace_back("a_f32", from_bits<uint32_t>({0x3fc00000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00123, 0x00000001},
                                              {2, 3}, at::kFloat));
  // 1.5, -0.0, signalling-NaN pattern, max finite bf16.
  t.emplace_back("b_bf16", from_bits<uint16_t>({0x3fc0, 0x8000, 0x7f81, 0x7f7f}, {4}, at::kBFloat16));
  // 1.0, 65504 (max), smallest denormal, -inf.
  t.emplace_back("c_f16", from_bits<uint16_t>({0x3c00, 0x7bff, 0x0001, 0xfc00}, {2, 2}, at::kHalf));
  t.emplace_back(
      "d_i64", from_bits<int64_t>({std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), -1, 0, 42},
                                  {5}, at::kLong));
  t.emplace_back("e_f64", from_bits<double>({-0.0, 1e-310, 3.141592653589793}, {1, 3, 1}, at::kDouble));
  t.emplace_back("f_i32", from_bits<int32_t>({std::numeric_limits<int32_t>::min(), 7}, {2}, at::kInt));
  t.emplace_back("g_i8", from_bits<int8_t>({-128, 127, 0}, {3}, at::kChar));
  t.emplace_back("h_u8", from_bits<uint8_t>({0, 255}, {2}, at::kByte));
  t.emplace_back("i_bool", from_bits<uint8_t>({1, 0, 1}, {3}, at::kBool));
  t.emplace_back("j_scalar", at::scalar_tensor(3.25, at::kFloat));  // 0-d
  t.emplace_back("k_empty", at::empty({0, 4}, at::kFloat));         // zero-size
  t.emplace_back("l_empty_bf16", at::empty({3, 0, 2}, at::kBFloat16));
  // The rarer dtypes: copied as bytes both ways, so one value pattern each is enough.
  t.emplace_back("m_i16", from_bits<int16_t>({-32768, 32767}, {2}, at::kShort));
  t.emplace_back("n_u16", from_bits<uint16_t>({0, 65535}, {2}, at::ScalarType::UInt16));
  t.emplace_back("o_u32", from_bits<uint32_t>({1, 0xffffffffu}, {2}, at::ScalarType::UInt32));
  t.emplace_back("p_u64", from_bits<uint64_t>({0xffffffffffffffffull}, {1}, at::ScalarType::UInt64));
  t.emplace_back("q_f8_e4m3", from_bits<uint8_t>({0x38, 0x7f, 0x80}, {3}, at::kFloat8_e4m3fn));  // 1, NaN, -0
  t.emplace_back("r_f8_e5m2", from_bits<uint8_t>({0x3c, 0x7c, 0x01}, {3}, at::kFloat8_e5m2));    // 1, inf, denormal
  return t;
}

// ---------------------------------------------------------------------------------------------------------
// The checkers themselves must reject known-bad inputs.

TEST(SafetensorsCheckers, BitEqualRejectsKnownBad) {
  const at::Tensor a = from_bits<uint32_t>({0x3fc00000, 0x7fc00123}, {2}, at::kFloat);
  EXPECT_TRUE(bit_equal(a, a.clone(), "same"));
  EXPECT_FALSE(bit_equal(a, from_bits<uint32_t>({0x3fc00000, 0x7fc00122}, {2}, at::kFloat), "NaN payload"));
  EXPECT_FALSE(bit_equal(from_bits<uint32_t>({0x80000000}, {1}, at::kFloat),
                         from_bits<uint32_t>({0x00000000}, {1}, at::kFloat), "-0.0 vs 0.0"));
  EXPECT_FALSE(bit_equal(a, a.view(at::kInt), "dtype"));
  EXPECT_FALSE(bit_equal(a, a.reshape({1, 2}), "shape"));
}

TEST(SafetensorsCheckers, ThrowsErrorRejectsKnownBad) {
  EXPECT_TRUE(throws_error([] { throw Error("file.st: tensor 'w'"); }, {"file.st", "'w'"}));
  EXPECT_FALSE(throws_error([] { throw Error("file.st"); }, {"file.st", "'w'"}));
  EXPECT_FALSE(throws_error([] { throw std::runtime_error("file.st"); }, {"file.st"}));
  EXPECT_FALSE(throws_error([] {}, {}));
}

// ---------------------------------------------------------------------------------------------------------
// Round trips and layout

TEST_F(SafetensorsTest, RoundTripIsBitExact) {
  const Named tensors = edge_tensors();
  const std::string file = path("edge.safetensors");
  write_file(file, tensors);
  EXPECT_FALSE(fs::exists(file + ".tmp"));

  const Reader r = Reader::open(file);
  std::vector<std::string> expected_names;
  for (const auto& kv : tensors) expected_names.push_back(kv.first);
  EXPECT_EQ(r.names(), expected_names);
  for (const auto& [name, want] : tensors) {
    ASSERT_TRUE(r.contains(name)) << name;
    const TensorInfo& ti = r.info(name);
    EXPECT_EQ(ti.name, name);
    EXPECT_EQ(ti.dtype, want.scalar_type()) << name;
    EXPECT_EQ(ti.shape, want.sizes().vec()) << name;
    EXPECT_EQ(ti.file, file);
    EXPECT_EQ(ti.end - ti.begin, static_cast<uint64_t>(want.numel()) * want.element_size()) << name;
    const at::Tensor got = r.load(name);
    EXPECT_TRUE(got.is_contiguous()) << name;
    EXPECT_EQ(got.device(), at::Device(at::kCPU)) << name;
    EXPECT_TRUE(bit_equal(got, want, name));
  }
  EXPECT_FALSE(r.contains("nope"));

  // load returns an owning copy: it outlives the Reader and writing to it does not reach the file.
  at::Tensor scalar;
  {
    const Reader r2 = Reader::open(file);
    scalar = r2.load("j_scalar");
    Reader copy = r2;  // copies share the mapping; the original going away must not unmap it
    EXPECT_TRUE(bit_equal(copy.load("d_i64"), tensors[3].second, "copied reader"));
  }
  EXPECT_EQ(scalar.item<float>(), 3.25f);
  scalar.fill_(7.0);
  EXPECT_EQ(r.load("j_scalar").item<float>(), 3.25f);
}

TEST_F(SafetensorsTest, NonContiguousInputIsWrittenInLogicalOrder) {
  const at::Tensor base = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor t = base.t();                                  // (4, 3), strides (1, 4)
  const at::Tensor sliced = base.select(/*dim=*/1, /*index=*/1);  // (3), stride 4
  write_file(path("nc.safetensors"), {{"sliced", sliced}, {"t", t}});
  const Reader r = Reader::open(path("nc.safetensors"));
  EXPECT_TRUE(bit_equal(r.load("t"), t.contiguous(), "transposed"));
  EXPECT_TRUE(bit_equal(r.load("sliced"), sliced.contiguous(), "sliced"));
}

TEST_F(SafetensorsTest, ByteLayoutMatchesTheFormat) {
  // One F32 (2) tensor [1, 2] and the default metadata: the header is the compact JSON below, padded with
  // spaces to a multiple of 8, then the 8 data bytes.
  const std::string file = path("layout.safetensors");
  write_file(file, {{"a", at::tensor({1.0f, 2.0f})}});
  std::string header = R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  ASSERT_EQ(header.size() % 8, 0u);
  const float data[2] = {1.0f, 2.0f};
  const std::string expected = u64_bytes(header.size()) + header + std::string(reinterpret_cast<const char*>(data), 8);
  EXPECT_EQ(read_bytes(file), expected);

  // Empty metadata: no "__metadata__" key at all; tensors keep the given (here unsorted) order, data packed.
  write_file(path("nometa.safetensors"), {{"z", at::tensor({int64_t{5}})}, {"y", at::tensor({int8_t{1}, int8_t{2}})}},
             {});
  const std::string bytes = read_bytes(path("nometa.safetensors"));
  const uint64_t n = header_length(bytes);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.substr(8, n).find("__metadata__"), std::string::npos);
  EXPECT_EQ(bytes.substr(8, n).rfind(R"({"z":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                                     R"("y":{"dtype":"I8","shape":[2],"data_offsets":[8,10]}})",
                                     0),
            0u);
  EXPECT_EQ(bytes.size(), 8 + n + 10);
}

TEST_F(SafetensorsTest, WriteReadWriteIsByteIdentical) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "1200"}};
  write_file(path("a.safetensors"), edge_tensors(), metadata);
  const Reader r = Reader::open(path("a.safetensors"));
  Named again;
  for (const std::string& name : r.names()) again.emplace_back(name, r.load(name));
  write_file(path("b.safetensors"), again, r.metadata());
  const std::string a = read_bytes(path("a.safetensors")), b = read_bytes(path("b.safetensors"));
  EXPECT_GT(a.size(), 8u);
  EXPECT_TRUE(a == b) << "rewritten file differs (" << a.size() << " vs " << b.size() << " bytes)";
}

TEST_F(SafetensorsTest, MetadataRoundTrip) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"quote", "a\"b\\c\nd"}, {"unicode", "h\xc3\xa9llo \xe2\x9c\x93"}, {"empty", ""}};
  write_file(path("m.safetensors"), {{"x", at::zeros({2})}}, metadata);
  EXPECT_EQ(Reader::open(path("m.safetensors")).metadata(), metadata);

  write_file(path("none.safetensors"), {{"x", at::zeros({2})}}, {});
  EXPECT_TRUE(Reader::open(path("none.safetensors")).metadata().empty());
}

TEST_F(SafetensorsTest, ShardedCheckpointRoundTrip) {
  // F32 sizes: a, b, c, d 400 bytes; big 1200 (> the 1000-byte limit alone); empty 0. Total 2800. Unsorted names, so
  // the test sees that shards keep the given order while the index's weight_map is sorted.
  const uint64_t kMaxShard = 1000;
  const Named tensors = {{"layers.2.a", at::randn({100})},   {"layers.10.b", at::randn({10, 10})},
                         {"big", at::randn({300})},          {"layers.0.c", at::randn({100})},
                         {"layers.1.d", at::randn({4, 25})}, {"empty", at::empty({0}, at::kFloat)}};
  const std::string dir = path("ckpt");
  fs::create_directories(dir);
  write_file(dir + "/model.safetensors", {{"stale", at::zeros({1})}});  // must be removed by the sharded write

  const std::vector<std::string> files = write_checkpoint(dir, tensors, kMaxShard);
  // Greedy: [a, b] = 800, [big] = 1200 alone, [c, d, empty] = 800.
  const std::vector<std::string> expected_files = {
      dir + "/model-00001-of-00003.safetensors", dir + "/model-00002-of-00003.safetensors",
      dir + "/model-00003-of-00003.safetensors", dir + "/model.safetensors.index.json"};
  EXPECT_EQ(files, expected_files);
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors"));
  const std::vector<std::vector<std::string>> expected_shards = {
      {"layers.10.b", "layers.2.a"}, {"big"}, {"empty", "layers.0.c", "layers.1.d"}};
  for (size_t i = 0; i < 3; ++i) {
    const Reader shard = Reader::open(files[i]);
    EXPECT_EQ(shard.names(), expected_shards[i]) << files[i];
    uint64_t bytes = 0;
    for (const std::string& name : shard.names()) bytes += shard.info(name).end - shard.info(name).begin;
    if (shard.names().size() > 1) {
      EXPECT_LE(bytes, kMaxShard) << files[i];
    }
  }
  // Shard 1 keeps the given order in its data buffer: layers.2.a first.
  EXPECT_EQ(Reader::open(files[0]).info("layers.2.a").begin, 0u);

  const std::string index_text = read_bytes(files[3]);
  const std::vector<std::string> sorted = {"big", "empty", "layers.0.c", "layers.1.d", "layers.10.b", "layers.2.a"};
  size_t last = 0;
  for (const std::string& name : sorted) {
    const size_t at = index_text.find("\"" + name + "\"");
    ASSERT_NE(at, std::string::npos) << name;
    EXPECT_GT(at, last) << name << " out of order in " << index_text;
    last = at;
  }
  EXPECT_NE(index_text.find("\"total_size\": 2800"), std::string::npos) << index_text;

  for (const std::string& open_path : {dir, files[3]}) {
    const Reader r = Reader::open(open_path);
    EXPECT_EQ(r.names(), sorted);
    for (const auto& [name, want] : tensors) EXPECT_TRUE(bit_equal(r.load(name), want, name + " via " + open_path));
    EXPECT_EQ(r.info("big").file, files[1]);
    EXPECT_EQ(r.metadata().at("total_size"), "2800");
    EXPECT_EQ(r.metadata().at("format"), "pt");
  }

  // Rewriting the same folder unsharded replaces the index; the Reader then sees the single file.
  EXPECT_EQ(write_checkpoint(dir, {{"only", at::ones({2})}}), std::vector<std::string>{dir + "/model.safetensors"});
  EXPECT_FALSE(fs::exists(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(Reader::open(dir).names(), std::vector<std::string>{"only"});
}

TEST_F(SafetensorsTest, LoadWithExpectedShapeAndDtype) {
  const std::string file = write_valid();
  const Reader r = Reader::open(file);
  // BF16 ones -> F32 is exact.
  const at::Tensor w = r.load("weight", {2, 3}, at::kFloat);
  EXPECT_TRUE(bit_equal(w, at::ones({2, 3}, at::kFloat), "cast weight"));
  EXPECT_TRUE(bit_equal(r.load("bias", {3}, at::kFloat), at::arange(3, at::kFloat), "uncast bias"));

  EXPECT_TRUE(throws_error([&] { r.load("weight", {3, 2}, at::kFloat); }, {file, "'weight'", "[3, 2]", "[2, 3]"}));
  EXPECT_TRUE(throws_error([&] { r.load("bias", {}, at::kFloat); }, {file, "'bias'", "[]", "[3]"}));
  EXPECT_TRUE(throws_error([&] { r.load("missing"); }, {file, "'missing'"}));
  EXPECT_TRUE(throws_error([&] { r.info("missing"); }, {file, "'missing'"}));
}

// ---------------------------------------------------------------------------------------------------------
// Writer errors: nothing is created, and an existing file of that name is left as it was.

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  const std::string file = write_valid("keep.safetensors");
  const std::string before = read_bytes(file);
  const at::Tensor x = at::zeros({2});
  EXPECT_TRUE(throws_error([&] { write_file(file, {{"x", x}, {"x", x}}); }, {file, "'x'", "duplicate"}));
  EXPECT_TRUE(throws_error([&] { write_file(file, {{"__metadata__", x}}); }, {file, "'__metadata__'"}));
  EXPECT_TRUE(throws_error([&] { write_file(file, {{"u", at::Tensor()}}); }, {file, "'u'", "undefined"}));
  EXPECT_TRUE(throws_error([&] { write_file(file, {{"c", at::zeros({2}, at::kComplexFloat)}}); }, {file, "'c'"}));
  EXPECT_EQ(read_bytes(file), before);
  EXPECT_FALSE(fs::exists(file + ".tmp"));

  const std::string nodir = path("no/such/dir/x.safetensors");
  EXPECT_TRUE(throws_error([&] { write_file(nodir, {{"x", x}}); }, {nodir}));
  const std::string ckpt = path("ckpt");
  EXPECT_TRUE(throws_error([&] { write_checkpoint(ckpt, {{"x", x}, {"x", x}}, 1); }, {ckpt, "'x'", "duplicate"}));
  EXPECT_FALSE(fs::exists(ckpt + "/model-00001-of-00002.safetensors"));
}

// ---------------------------------------------------------------------------------------------------------
// Corrupt inputs: every one an Error naming the file (and the tensor where one is involved).

TEST_F(SafetensorsTest, CorruptLengthPrefix) {
  const std::string file = write_valid();
  const std::string bytes = read_bytes(file);

  write_bytes(file, bytes.substr(0, 5));  // shorter than the 8-byte prefix
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "shorter than the 8-byte"}));
  write_bytes(file, "");
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "0 bytes"}));

  write_bytes(file, u64_bytes(bytes.size() - 7) + bytes.substr(8));  // one byte more than is there
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "exceeds"}));

  write_bytes(file, u64_bytes(uint64_t{1} << 40) + bytes.substr(8));  // absurd
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "limit"}));

  write_bytes(file, u64_bytes(std::numeric_limits<uint64_t>::max()) + bytes.substr(8));  // 8 + N would wrap
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "limit"}));

  write_bytes(file, u64_bytes(0) + bytes.substr(8));  // empty header
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "not valid JSON"}));
}

TEST_F(SafetensorsTest, CorruptHeaderJson) {
  const std::string file = write_valid();
  std::string bytes = read_bytes(file);
  bytes[8] = '(';  // the opening brace
  write_bytes(file, bytes);
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "not valid JSON"}));

  write_valid();
  patch_header(file, "\"weight\"", "\"weight");
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "not valid JSON"}));

  write_valid();
  set_header(file, "[1, 2, 3]");
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "not a JSON object"}));

  write_valid();
  patch_header(file, R"({"format":"pt"})", R"({"format":1})");
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "__metadata__", "format"}));

  write_valid();
  patch_header(file, R"({"format":"pt"})", R"("pt")");
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "__metadata__"}));

  write_valid();
  set_header(file, R"({"weight":[1]})");
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "'weight'", "not a JSON object"}));
}

TEST_F(SafetensorsTest, CorruptEntryFields) {
  const std::string file = path("valid.safetensors");
  struct Case {
    std::string from, to, expect;
  };
  // The weight entry reads {"dtype":"BF16","shape":[2,3],"data_offsets":[12,24]}.
  const std::vector<Case> cases = {
      {R"("dtype":"BF16",)", "", "missing \"dtype\""},
      {R"("dtype":"BF16")", R"("dtype":16)", "\"dtype\" is not a string"},
      {R"("BF16")", R"("BX16")", "unknown dtype \"BX16\""},
      {R"("shape":[2,3],)", "", "missing \"shape\""},
      {R"("shape":[2,3])", R"("shape":"2x3")", "\"shape\" is not an array"},
      {R"("shape":[2,3])", R"("shape":[2.5,3])", "non-integer"},
      {R"("shape":[2,3])", R"("shape":[-2,3])", "negative dimension -2"},
      {R"("shape":[2,3])", R"("shape":[4294967296,4294967296,4294967296])", "overflows"},
      {R"("shape":[2,3])", R"("shape":[99999999999999999999])", "non-integer"},  // > u64: parsed as float
      {R"(,"data_offsets":[12,24])", "", "missing \"data_offsets\""},
      {R"([12,24])", R"([12])", "data_offsets"},
      {R"([12,24])", R"("12-24")", "data_offsets"},
      {R"([12,24])", R"([-12,24])", "data_offsets"},
      {R"([12,24])", R"([24,12])", "end before begin"},
      {R"([12,24])", R"([12,99])", "past the end of the file"},
      {R"([12,24])", R"([12,18446744073709551615])", "past the end of the file"},
      {R"([12,24])", R"([12,20])", "needs 12"},
      {R"("shape":[2,3])", R"("shape":[3,3])", "needs 18"},
  };
  for (const Case& c : cases) {
    write_valid();
    patch_header(file, c.from, c.to);
    EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "'weight'", c.expect})) << c.from << " -> " << c.to;
  }
}

TEST_F(SafetensorsTest, DataPastTheFileEnd) {
  const std::string file = write_valid();
  const std::string bytes = read_bytes(file);
  write_bytes(file, bytes.substr(0, bytes.size() - 4));  // weight's [12, 24) now ends 4 bytes past the file
  EXPECT_TRUE(throws_error([&] { Reader::open(file); }, {file, "'weight'", "past the end of the file"}));
}

TEST_F(SafetensorsTest, BoolBytesOtherThanZeroOrOne) {
  const std::string file = path("bool.safetensors");
  write_file(file, {{"mask", at::ones({4}, at::kBool)}});
  std::string bytes = read_bytes(file);
  bytes[bytes.size() - 2] = 2;
  write_bytes(file, bytes);
  const Reader r = Reader::open(file);  // the header is fine; the bad byte is found on load
  EXPECT_TRUE(throws_error([&] { r.load("mask"); }, {file, "'mask'", "BOOL byte 2 is 2"}));
}

TEST_F(SafetensorsTest, MissingPaths) {
  const std::string missing = path("nope.safetensors");
  EXPECT_TRUE(throws_error([&] { Reader::open(missing); }, {missing, "no such file"}));
  const std::string empty_dir = path("empty");
  fs::create_directories(empty_dir);
  EXPECT_TRUE(throws_error([&] { Reader::open(empty_dir); }, {empty_dir, "model.safetensors.index.json"}));
}

TEST_F(SafetensorsTest, CorruptIndex) {
  const std::string dir = path("ckpt");
  const Named tensors = {{"a", at::ones({100})}, {"b", at::ones({100})}, {"c", at::ones({100})}};
  const auto rewrite = [&] { return write_checkpoint(dir, tensors, 800); };  // [a, b], [c]
  const std::string index = dir + "/model.safetensors.index.json";
  const std::string shard2 = dir + "/model-00002-of-00002.safetensors";

  rewrite();
  fs::remove(shard2);
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {index, "'c'", shard2, "does not exist"}));

  rewrite();
  std::string text = read_bytes(index);
  const std::string from = "\"a\": \"model-00001-of-00002.safetensors\"";
  ASSERT_NE(text.find(from), std::string::npos) << text;
  text.replace(text.find(from), from.size(), "\"a\": \"model-00002-of-00002.safetensors\"");
  write_bytes(index, text);
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {shard2, "'a'", "not in this shard", index}));

  rewrite();
  text = read_bytes(index);
  text.replace(text.find(from), from.size(), "\"a\": \"../model-00001-of-00002.safetensors\"");
  write_bytes(index, text);
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {index, "'a'", "relative path"}));

  write_bytes(index, "{\"weight_map\": ");
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {index, "not valid JSON"}));
  write_bytes(index, "{\"metadata\": {}}");
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {index, "weight_map"}));
  write_bytes(index, "{\"weight_map\": {\"a\": 1}}");
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {index, "'a'", "not a string"}));

  // A corrupt shard reports the shard's own path.
  rewrite();
  const std::string shard1 = dir + "/model-00001-of-00002.safetensors";
  patch_header(shard1, R"("F32")", R"("X32")");
  EXPECT_TRUE(throws_error([&] { Reader::open(dir); }, {shard1, "unknown dtype"}));
}

// ---------------------------------------------------------------------------------------------------------
// Interoperability with the reference implementation (Python safetensors), when installed.

// The same tensors on both sides; values exactly representable in every dtype used.
constexpr const char* kPythonScript = R"PY(
import json, os, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

def tensors():
    return {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.25 - 1,
        "bf16": torch.tensor([1.5, -2.0, 0.0078125], dtype=torch.bfloat16),
        "f16": torch.tensor([[65504.0, -0.5]], dtype=torch.float16),
        "i64": torch.tensor([-(2**63), 2**63 - 1, 7], dtype=torch.int64),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "flag": torch.tensor([True, False, True]),
    }

def check(got, what):
    exp = tensors()
    assert sorted(got) == sorted(exp), (what, sorted(got))
    for k, v in exp.items():
        g = got[k]
        assert g.dtype == v.dtype and g.shape == v.shape and torch.equal(g, v), (what, k, g, v)

mode, d = sys.argv[1], sys.argv[2]
if mode == "write":
    save_file(tensors(), os.path.join(d, "py.safetensors"), metadata={"format": "pt"})
else:
    path = os.path.join(d, "ours.safetensors")
    check(load_file(path), path)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "origin": "rlt"}, f.metadata()
    ckpt = os.path.join(d, "ckpt")
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
    merged = {}
    for shard in sorted(set(index["weight_map"].values())):
        merged.update(load_file(os.path.join(ckpt, shard)))
    check(merged, ckpt)
    print("OK")
)PY";

Named interop_tensors() {  // mirrors tensors() in kPythonScript, in sorted name order
  return {{"bf16", at::tensor({1.5f, -2.0f, 0.0078125f}).to(at::kBFloat16)},
          {"empty", at::zeros({0, 4}, at::kFloat)},
          {"f16", at::tensor({65504.0f, -0.5f}).reshape({1, 2}).to(at::kHalf)},
          {"f32", at::arange(6, at::kFloat).reshape({2, 3}) * 0.25 - 1},
          {"flag", from_bits<uint8_t>({1, 0, 1}, {3}, at::kBool)},
          {"i64", at::tensor({std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), int64_t{7}})},
          {"scalar", at::scalar_tensor(3.25, at::kFloat)}};
}

TEST_F(SafetensorsTest, InteropWithPythonSafetensors) {
  // The configured Python (CMake's Python3_EXECUTABLE): it must have safetensors and torch, so a missing
  // package fails here instead of skipping silently.
  const std::string python = RLT_PYTHON;
  ASSERT_EQ(std::system(("'" + python + "' -c 'import safetensors, torch' > /dev/null 2>&1").c_str()), 0)
      << python << " cannot import safetensors and torch (scripts/setup.sh installs them)";
  const std::string script = path("interop.py"), out = path("py_out.txt"), d = dir_.string();
  write_bytes(script, kPythonScript);
  const auto run = [&](const std::string& mode) {
    const int rc =
        std::system(("'" + python + "' '" + script + "' " + mode + " '" + d + "' > '" + out + "' 2>&1").c_str());
    return std::make_pair(rc, read_bytes(out));
  };

  // Python writes, we read: exact values, dtypes, shapes, metadata.
  const auto [rc_w, log_w] = run("write");
  ASSERT_EQ(rc_w, 0) << log_w;
  const std::string py_file = path("py.safetensors");
  const Reader r = Reader::open(py_file);
  const Named expected = interop_tensors();
  std::vector<std::string> names;
  for (const auto& [name, want] : expected) {
    EXPECT_TRUE(bit_equal(r.load(name), want, "python-written " + name));
    names.push_back(name);
  }
  EXPECT_EQ(r.names(), names);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

  // Rewriting Python's tensors in its data order reproduces its file byte for byte: same compact header,
  // key order and space padding as the reference writer.
  std::vector<const TensorInfo*> by_offset;
  for (const std::string& name : r.names()) by_offset.push_back(&r.info(name));
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  Named ordered;
  for (const TensorInfo* ti : by_offset) ordered.emplace_back(ti->name, r.load(ti->name));
  write_file(path("rewritten.safetensors"), ordered, r.metadata());
  EXPECT_TRUE(read_bytes(path("rewritten.safetensors")) == read_bytes(py_file))
      << "header ours: " << read_bytes(path("rewritten.safetensors")).substr(0, 300)
      << "\nheader python: " << read_bytes(py_file).substr(0, 300);

  // We write (one file and a sharded checkpoint), Python reads.
  write_file(path("ours.safetensors"), expected, {{"format", "pt"}, {"origin", "rlt"}});
  ASSERT_EQ(write_checkpoint(path("ckpt"), expected, /*max_shard_bytes=*/32).size(), 4u);  // 3 shards + index
  const auto [rc_c, log_c] = run("check");
  EXPECT_EQ(rc_c, 0) << log_c;
  EXPECT_NE(log_c.find("OK"), std::string::npos) << log_c;
}

}  // namespace
}  // namespace rlt::safetensors
