// Reading and writing Hugging Face safetensors checkpoints: one .safetensors file, or a folder of shards
// named by model.safetensors.index.json. Files are memory-mapped read-only and every header field is
// checked against the file before a byte of tensor data is touched, so a truncated or corrupt file gives
// an Error naming the file (and the tensor), never a crash or a read past the mapping.
// Left out: zero-copy tensors (load always copies into an owning CPU tensor), checks that tensors do not
// overlap or leave gaps (the reference implementation rejects both; readers never need it), complex
// dtypes, and big-endian hosts (the format is little-endian; a static_assert refuses to build there).
// A file truncated by another process while mapped can still raise SIGBUS: mmap cannot guard that.
//
// File layout (https://github.com/huggingface/safetensors):
//   [8 bytes]  N, little-endian u64
//   [N bytes]  UTF-8 JSON object: {"__metadata__": {str: str} (optional),
//                                  "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}}
//              (padded with spaces to a multiple of 8 by writers)
//   [rest]     data buffer; [begin, end) are byte offsets into it, row-major, little-endian.
// Sharded folder: model-00001-of-0000n.safetensors ... plus model.safetensors.index.json =
//   {"metadata": {"total_size": <bytes of tensor data>}, "weight_map": {"<name>": "<shard file>"}}.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace rlt::safetensors {

// Every failure of this module. The message always names the file and, where one is involved, the tensor.
class Error : public std::runtime_error {
 public:
  using runtime_error::runtime_error;
};

struct TensorInfo {
  std::string name;
  at::ScalarType dtype;         // the file's dtype (F32 -> at::kFloat, BF16 -> at::kBFloat16, ...)
  std::vector<int64_t> shape;   // empty for a 0-d scalar
  std::string file;             // path of the .safetensors file holding it
  uint64_t begin = 0, end = 0;  // byte offsets within that file's data buffer; end - begin = numel * itemsize
};

// Supported dtypes, both ways: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL U16 U32 U64 F8_E4M3 F8_E5M2.
// Returns the safetensors name, or nullptr when the ScalarType has none (complex, quantized, ...).
const char* dtype_name(at::ScalarType dtype);

namespace detail {
struct MappedFile;  // one read-only mapping; unmapped when the last Reader copy holding it goes away
}

// Opens a .safetensors file, or a folder holding model.safetensors or model.safetensors.index.json
// (+ shards), or an index.json path itself. A folder holding both is read as model.safetensors (as
// transformers does; write_checkpoint never leaves both). Files are memory-mapped read-only for the
// Reader's lifetime; tensors are copied out on load. Copies of a Reader share the mappings.
class Reader {
 public:
  static Reader open(const std::string& path);

  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  // Throws Error naming the missing tensor and the path given to open.
  const TensorInfo& info(const std::string& name) const;
  // CPU, contiguous, owning copy, in the file's dtype. BOOL bytes other than 0/1 are an Error (a bool
  // tensor holding 2 is undefined behaviour in ATen kernels).
  at::Tensor load(const std::string& name) const;
  // load + checks: the stored shape must equal `shape`, then the result is cast to `dtype`. The Error
  // names the file, the tensor, and the expected vs found shape and dtype.
  at::Tensor load(const std::string& name, at::IntArrayRef shape, at::ScalarType dtype) const;
  // A single file: its "__metadata__". A sharded folder: the first shard's (by file name) "__metadata__",
  // overlaid with the index's "metadata", non-string values written as compact JSON (total_size -> "1234").
  const std::map<std::string, std::string>& metadata() const;
  const std::string& path() const { return path_; }  // as given to open

 private:
  std::string path_;
  std::map<std::string, TensorInfo> tensors_;                               // by tensor name
  std::map<std::string, std::shared_ptr<const detail::MappedFile>> files_;  // by TensorInfo::file
  std::map<std::string, std::string> metadata_;
};

// Writes one file. Tensors are written in the order given (callers pass a sorted list for determinism);
// header keys in the same order, "__metadata__" first when non-empty; data contiguous, no gaps; the header
// is compact JSON padded with spaces to a multiple of 8 bytes (as the reference implementation does).
// Tensors on any device and of any layout are copied to contiguous CPU memory one at a time while writing.
// Writes to "<file>.tmp", fsyncs, then renames, so a crash never leaves a half-written file under the final
// name. Throws Error (before creating anything) on a duplicate name, a tensor named "__metadata__", an
// undefined tensor, or a dtype with no safetensors name.
void write_file(const std::string& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes `dir`/model.safetensors when the total tensor bytes are <= max_shard_bytes, else shards
// model-0000i-of-0000n.safetensors (each <= max_shard_bytes unless one tensor alone is larger; tensors kept
// in the given order, split greedily) plus model.safetensors.index.json (weight_map sorted by name,
// metadata.total_size). Creates `dir` if needed. The index is written last, then a stale model.safetensors
// (or, for a single file, a stale index) is removed, so an interrupted write leaves the previous checkpoint
// readable. Shards of an earlier, larger write that the new index does not name are left in place.
// Returns the files written (shards in order, then the index).
std::vector<std::string> write_checkpoint(const std::string& dir,
                                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                          uint64_t max_shard_bytes = 5ull << 30);

}  // namespace rlt::safetensors
