// TensorBoard event files, written without TensorFlow or protobuf: each record is TFRecord framing
// (length, masked CRC-32C of the length, the bytes, their masked CRC-32C) around one serialized
// tensorflow.Event message, encoded here field by field in the order and form protobuf's own
// serializer gives (tests/common/tensorboard_reference.py writes the same events with TensorBoard's
// classes, and the files must be equal byte for byte). The messages used:
//   Event          wall_time (1, double), step (2, int64), file_version (3, string), summary (5)
//   Summary        value (1, repeated)
//   Summary.Value  tag (1), simple_value (2, float), tensor (8), metadata (9)
//   SummaryMetadata.plugin_data (1): plugin_name (1)
//   TensorProto    dtype (1, DT_STRING = 7), tensor_shape (2, empty: a scalar), string_val (8)
// `tensorboard --logdir DIR` shows them; `wandb sync --sync-tensorboard DIR` uploads them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace rlt {

// CRC-32C (Castagnoli, reflected, as iSCSI and TFRecord use it) of n bytes.
uint32_t crc32c(const void* data, size_t n);
// TFRecord's masked form: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// The serialized Event messages (proto3: a zero wall_time or step is left out, as protobuf leaves it).
std::string event_file_version(double wall_time);
std::string event_scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);
// A text summary: the text plugin's (plugin_name "text") scalar string tensor; TensorBoard renders it as
// Markdown.
std::string event_text(double wall_time, int64_t step, const std::string& tag, const std::string& text);
// One TFRecord around a serialized message.
std::string tfrecord(const std::string& data);

// Seconds since the epoch, the events' wall_time.
double wall_seconds();

// One event file in `dir` (made if missing): events.out.tfevents.<seconds>.<host>.<pid>.<n>.rlt, n
// counting this process's writers, so each writer has its own (a resumed run adds a file; TensorBoard
// reads every file of the folder). Its first
// record is the file_version event ("brain.Event:2"). Throws std::runtime_error when the file cannot be
// written.
class EventWriter {
 public:
  explicit EventWriter(const std::string& dir, double wall_time = wall_seconds());
  // Every value a scalar at `step`, tagged by its key, in float32 (TensorBoard's simple_value); a value
  // that is not finite goes in as it is (TensorBoard draws NaN and inf as gaps).
  void scalars(int64_t step, const std::map<std::string, double>& values, double wall_time = wall_seconds());
  void text(int64_t step, const std::string& tag, const std::string& text, double wall_time = wall_seconds());
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& event);
  std::string path_;
  std::ofstream file_;
};

}  // namespace rlt
