// TensorBoard event files (common/tensorboard.h) against TensorBoard itself
// (tests/common/tensorboard_reference.py, the tensorboard package): the same events written by its
// RecordWriter and protobuf classes must equal ours byte for byte, and its loader, which checks both CRCs
// of every record, must read ours back to the values written, and stop at a record with a flipped CRC
// byte or cut short. CRC-32C must match the published check values and not plain CRC-32's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/tensorboard.h"
#include "tests/common/files.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::bytes_of;
using testing::read_json;

void write_bytes(const fs::path& p, const std::string& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << b;
}

// Runs tensorboard_reference.py; its exit code.
int reference(const std::string& mode, const fs::path& a, const fs::path& b) {
  const std::string cmd = std::string(RLT_PYTHON) + " " + RLT_SOURCE_DIR + "/tests/common/tensorboard_reference.py " +
                          mode + " '" + a.string() + "' '" + b.string() + "' 2> '" + b.string() + ".err'";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// The tensorboard package is there (scripts/setup.sh installs it; a GPU host may lack it).
bool have_tensorboard() {
  const std::string cmd = std::string(RLT_PYTHON) + " -c 'import tensorboard' 2> /dev/null";
  return std::system(cmd.c_str()) == 0;
}

TEST(Crc32c, PublishedCheckValues) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xe3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720, B.4
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  EXPECT_NE(crc32c(digits.data(), digits.size()), 0xcbf43926u) << "plain CRC-32's check value";
  const uint32_t c = crc32c(digits.data(), digits.size());
  EXPECT_EQ(masked_crc32c(digits.data(), digits.size()), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, EventsEqualTensorBoardsOwnByteForByteAndReadBack) {
  if (!have_tensorboard()) GTEST_SKIP() << "tensorboard is not installed (scripts/setup.sh installs it)";
  const testing::TempDir tmp("tensorboard");
  // Scalars at step 0 (the field left out), at a step of several varint bytes and at a negative one (ten
  // bytes), with zero, negative, tiny and large values and many tags; text with Markdown, non-ASCII
  // characters and more than 127 bytes (a two-byte length).
  std::string long_text = "**prompt**\n\n```\nwhat is 17 * 23?\n```\n\n";
  for (int i = 0; i < 20; ++i) long_text += "step " + std::to_string(i) + ": ≈ λ x. x + 1\n";
  json spec = json::array();
  spec.push_back({{"wall_time", 1764400000.25}, {"file_version", "brain.Event:2"}});
  spec.push_back({{"wall_time", 1764400001.5},
                  {"step", 0},
                  {"scalars", json::array({json::array({"loss", 0.0}), json::array({"reward_mean", -0.75})})}});
  json many = json::array();
  for (int i = 0; i < 40; ++i) {
    many.push_back(json::array({"rollout/metric_" + std::to_string(i), std::pow(-3.0, i % 7) * 1.1e-30 * (i + 1)}));
  }
  many.push_back(json::array({"update_flops", 4.97e14}));
  spec.push_back({{"wall_time", 1764400002.0}, {"step", int64_t(1) << 40}, {"scalars", many}});
  spec.push_back({{"wall_time", 1764400003.0}, {"step", -1}, {"scalars", json::array({json::array({"x", 1.0})})}});
  spec.push_back({{"wall_time", 1764400004.0}, {"step", 7}, {"text", json::array({"samples/0", long_text})}});
  spec.push_back({{"wall_time", 0.0}, {"step", 8}, {"text", json::array({"samples/1", ""})}});

  std::string ours;
  for (const json& e : spec) {
    const double w = e["wall_time"].get<double>();
    const int64_t step = e.value("step", int64_t(0));
    if (e.contains("file_version")) {
      ours += tfrecord(event_file_version(w));
    } else if (e.contains("scalars")) {
      std::vector<std::pair<std::string, float>> v;
      for (const json& s : e["scalars"])
        v.emplace_back(s[0].get<std::string>(), static_cast<float>(s[1].get<double>()));
      ours += tfrecord(event_scalars(w, step, v));
    } else {
      ours += tfrecord(event_text(w, step, e["text"][0].get<std::string>(), e["text"][1].get<std::string>()));
    }
  }
  const fs::path spec_path = tmp.path() / "spec.json", theirs_path = tmp.path() / "theirs",
                 ours_path = tmp.path() / "ours";
  std::ofstream(spec_path) << spec.dump();
  write_bytes(ours_path, ours);
  ASSERT_EQ(reference("write", spec_path, theirs_path), 0) << bytes_of(theirs_path.string() + ".err");
  const std::string theirs = bytes_of(theirs_path);
  EXPECT_EQ(ours.size(), theirs.size());
  EXPECT_TRUE(ours == theirs) << "ours and TensorBoard's bytes differ";

  // TensorBoard's loader reads ours back.
  const fs::path read_path = tmp.path() / "read.json";
  ASSERT_EQ(reference("read", ours_path, read_path), 0) << bytes_of(read_path.string() + ".err");
  const json got = read_json(read_path);
  ASSERT_EQ(got.size(), spec.size());
  EXPECT_EQ(got[0]["file_version"], "brain.Event:2");
  for (size_t i = 0; i < spec.size(); ++i) {
    EXPECT_EQ(got[i]["wall_time"].get<double>(), spec[i]["wall_time"].get<double>()) << i;
    EXPECT_EQ(got[i]["step"].get<int64_t>(), spec[i].value("step", int64_t(0))) << i;
    if (spec[i].contains("scalars")) {
      ASSERT_EQ(got[i]["values"].size(), spec[i]["scalars"].size());
      for (size_t k = 0; k < spec[i]["scalars"].size(); ++k) {
        EXPECT_EQ(got[i]["values"][k]["tag"], spec[i]["scalars"][k][0]);
        EXPECT_EQ(got[i]["values"][k]["simple_value"].get<double>(),
                  double(static_cast<float>(spec[i]["scalars"][k][1].get<double>())));
      }
    }
    if (spec[i].contains("text")) {
      const json& v = got[i]["values"][0];
      EXPECT_EQ(v["tag"], spec[i]["text"][0]);
      EXPECT_EQ(v["plugin"], "text");
      EXPECT_EQ(v["dims"], 0) << "a scalar string tensor";
      EXPECT_EQ(v["text"], json::array({spec[i]["text"][1]}));
    }
  }

  // Wrong files: TensorBoard's loader stops at a record whose CRC fails (as at a record still being
  // written), so a writer with a wrong CRC loses that record and every one after it. A flipped byte in
  // the first record's data CRC: nothing read; in the second record's length CRC: only the first; the
  // last record cut short: all but it.
  auto events_read = [&](const std::string& bytes, const std::string& name) {
    write_bytes(tmp.path() / name, bytes);
    EXPECT_EQ(reference("read", tmp.path() / name, tmp.path() / (name + ".json")), 0) << name;
    return read_json(tmp.path() / (name + ".json")).size();
  };
  const size_t first = tfrecord(event_file_version(1764400000.25)).size();  // the second record starts here
  std::string bad = ours;
  bad[first - 1] ^= 0x01;
  EXPECT_EQ(events_read(bad, "bad_data_crc"), 0u);
  bad = ours;
  bad[first + 8] ^= 0x40;
  EXPECT_EQ(events_read(bad, "bad_length_crc"), 1u);
  EXPECT_EQ(events_read(ours.substr(0, ours.size() - 2), "short"), spec.size() - 1);
}

// The writer's file: a new one per writer in the folder, named as TensorBoard's glob finds it, the
// file_version event first; TensorBoard's accumulator gives every scalar at its step and the text.
TEST(TensorBoard, WriterFilesLoadAsTensorBoardsUiLoadsThem) {
  if (!have_tensorboard()) GTEST_SKIP() << "tensorboard is not installed (scripts/setup.sh installs it)";
  const testing::TempDir tmp("tensorboard_writer");
  const fs::path dir = tmp.path() / "tensorboard";
  std::string first;
  {
    EventWriter w(dir.string(), 1764400000.0);
    first = w.path();
    w.scalars(1, {{"reward_mean", 0.25}, {"accuracy", 0.5}}, 1764400001.0);
    w.scalars(2, {{"reward_mean", 0.5}, {"accuracy", 0.75}}, 1764400002.0);
    w.text(2, "samples/0", "**reward** 1", 1764400002.0);
  }
  {
    EventWriter w(dir.string(), 1764400000.0);  // a resumed run's, in the same second
    EXPECT_NE(w.path(), first);
    w.scalars(3, {{"reward_mean", 1.0}, {"accuracy", 1.0}}, 1764400011.0);
  }
  EXPECT_EQ(fs::path(first).filename().string().rfind("events.out.tfevents.1764400000.", 0), 0u) << first;
  EXPECT_EQ(bytes_of(first).substr(0, tfrecord(event_file_version(1764400000.0)).size()),
            tfrecord(event_file_version(1764400000.0)));
  const fs::path out = tmp.path() / "acc.json";
  ASSERT_EQ(reference("accumulate", dir, out), 0) << bytes_of(out.string() + ".err");
  const json got = read_json(out);
  EXPECT_EQ(got["scalars"]["reward_mean"], json::parse("[[1, 0.25], [2, 0.5], [3, 1.0]]"));
  EXPECT_EQ(got["scalars"]["accuracy"], json::parse("[[1, 0.5], [2, 0.75], [3, 1.0]]"));
  EXPECT_EQ(got["text"]["samples/0"], json::parse("[[2, \"**reward** 1\"]]"));
  EXPECT_THROW(EventWriter(first + "/x"), std::runtime_error) << "a file where the folder goes";
}

}  // namespace
}  // namespace rlt
