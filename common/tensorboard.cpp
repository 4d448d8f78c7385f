// TensorBoard event files; see tensorboard.h.
#include "common/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace rlt {

namespace {

// The reflected Castagnoli polynomial's table, one byte at a time.
const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protobuf's wire format: a field's key is (number << 3) | wire type; 0 varint, 1 fixed64, 2 length-
// delimited, 5 fixed32.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void key(std::string& out, int field, int wire) { varint(out, (uint64_t(field) << 3) | uint64_t(wire)); }

template <typename T>
void little_endian(std::string& out, T bits) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
}

void bytes_field(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}

void double_field(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  key(out, field, 1);
  little_endian(out, bits);
}

void float_field(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  key(out, field, 5);
  little_endian(out, bits);
}

// The fields every event starts with; proto3 leaves out a scalar field at its default (0).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  if (wall_time != 0) double_field(e, 1, wall_time);
  if (step != 0) {
    key(e, 2, 0);
    varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

std::string summary_event(double wall_time, int64_t step, const std::string& summary) {
  std::string e = event_head(wall_time, step);
  bytes_field(e, 5, summary);
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& t = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string event_file_version(double wall_time) {
  std::string e = event_head(wall_time, 0);
  bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    float_field(value, 2, v);  // in a oneof: written even when 0
    bytes_field(summary, 1, value);
  }
  return summary_event(wall_time, step, summary);
}

std::string event_text(double wall_time, int64_t step, const std::string& tag, const std::string& text) {
  std::string tensor;
  key(tensor, 1, 0);
  varint(tensor, 7);             // DT_STRING
  bytes_field(tensor, 2, "");    // tensor_shape: no dims, a scalar
  bytes_field(tensor, 8, text);  // string_val
  std::string plugin, metadata, value, summary;
  bytes_field(plugin, 1, "text");
  bytes_field(metadata, 1, plugin);
  bytes_field(value, 1, tag);
  bytes_field(value, 8, tensor);
  bytes_field(value, 9, metadata);
  bytes_field(summary, 1, value);
  return summary_event(wall_time, step, summary);
}

std::string tfrecord(const std::string& data) {
  std::string r;
  std::string length;
  little_endian(length, static_cast<uint64_t>(data.size()));
  r += length;
  little_endian(r, masked_crc32c(length.data(), length.size()));
  r += data;
  little_endian(r, masked_crc32c(data.data(), data.size()));
  return r;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

EventWriter::EventWriter(const std::string& dir, double wall_time) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0 || host[0] == 0) std::strcpy(host, "localhost");
  // Seconds, host and process, then a count of this process's writers: two in one second stay apart.
  static std::atomic<int64_t> writers{0};
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(int64_t(wall_time)) + "." + host +
                                         "." + std::to_string(getpid()) + "." + std::to_string(writers++) + ".rlt"))
              .string();
  file_.open(path_, std::ios::binary | std::ios::trunc);
  if (!file_) throw std::runtime_error(path_ + ": cannot open for writing");
  write(event_file_version(wall_time));
  flush();
}

void EventWriter::scalars(int64_t step, const std::map<std::string, double>& values, double wall_time) {
  std::vector<std::pair<std::string, float>> v;
  v.reserve(values.size());
  for (const auto& [tag, x] : values) v.emplace_back(tag, static_cast<float>(x));
  write(event_scalars(wall_time, step, v));
}

void EventWriter::text(int64_t step, const std::string& tag, const std::string& text, double wall_time) {
  write(event_text(wall_time, step, tag, text));
}

void EventWriter::flush() {
  file_.flush();
  if (!file_) throw std::runtime_error(path_ + ": write failed");
}

void EventWriter::write(const std::string& event) {
  const std::string r = tfrecord(event);
  file_.write(r.data(), static_cast<std::streamsize>(r.size()));
}

}  // namespace rlt
