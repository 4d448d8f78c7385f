// safetensors reading (mmap + header validation) and writing (tmp file + rename). See safetensors.h for the
// format. Every check on a header happens in parse_file, before any tensor byte is read; load only copies.
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

namespace rlt::safetensors {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian and is copied as is; big-endian hosts are not supported");

namespace detail {
struct MappedFile {
  std::string path;
  const uint8_t* base = nullptr;  // the whole file
  size_t size = 0;
  const uint8_t* data = nullptr;  // the data buffer: base + 8 + N
  uint64_t data_size = 0;

  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (base != nullptr) ::munmap(const_cast<uint8_t*>(base), size);
  }
};
}  // namespace detail

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The reference implementation's limit (safetensors/src/tensor.rs, MAX_HEADER_SIZE): a longer header is
// taken as corruption rather than parsed. Real headers are ~100 bytes per tensor.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::ScalarType::Double},
    {"F32", at::ScalarType::Float},
    {"F16", at::ScalarType::Half},
    {"BF16", at::ScalarType::BFloat16},
    {"I64", at::ScalarType::Long},
    {"I32", at::ScalarType::Int},
    {"I16", at::ScalarType::Short},
    {"I8", at::ScalarType::Char},
    {"U8", at::ScalarType::Byte},
    {"BOOL", at::ScalarType::Bool},
    {"U16", at::ScalarType::UInt16},
    {"U32", at::ScalarType::UInt32},
    {"U64", at::ScalarType::UInt64},
    {"F8_E4M3", at::ScalarType::Float8_e4m3fn},
    {"F8_E5M2", at::ScalarType::Float8_e5m2},
};

std::optional<at::ScalarType> dtype_from_name(const std::string& name) {
  for (const DtypeName& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  return std::nullopt;
}

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw Error("safetensors: " + file + ": " + what);
}

[[noreturn]] void fail(const std::string& file, const std::string& tensor, const std::string& what) {
  throw Error("safetensors: " + file + ": tensor '" + tensor + "': " + what);
}

std::string errno_text() { return std::strerror(errno); }

std::string shape_text(at::IntArrayRef shape) {
  std::ostringstream os;
  os << shape;
  return os.str();
}

// A non-negative JSON integer. Floats, negatives and strings give nullopt; integers above 2^64-1 are parsed
// by nlohmann as floats and so are rejected too.
std::optional<uint64_t> as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

struct ParsedFile {
  std::shared_ptr<const detail::MappedFile> mapped;
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

std::shared_ptr<detail::MappedFile> map_file(const std::string& path) {
  auto m = std::make_shared<detail::MappedFile>();  // owns the mapping from the moment it exists
  m->path = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "not a readable regular file");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, "file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string mmap_error = p == MAP_FAILED ? errno_text() : "";
  ::close(fd);  // the mapping keeps the file open
  if (p == MAP_FAILED) fail(path, "mmap failed: " + mmap_error);
  m->base = static_cast<const uint8_t*>(p);
  m->size = size;
  return m;
}

// Maps `path` and checks its whole header: after this, every [begin, end) lies inside the data buffer
// and holds exactly numel * itemsize bytes, so load can memcpy without further checks.
ParsedFile parse_file(const std::string& path) {
  std::shared_ptr<detail::MappedFile> m = map_file(path);
  uint64_t n = 0;
  std::memcpy(&n, m->base, 8);  // little-endian host (static_assert above)
  if (n > kMaxHeaderBytes) {
    fail(path, "header length " + std::to_string(n) + " is over the " + std::to_string(kMaxHeaderBytes) +
                   "-byte limit (corrupt length prefix?)");
  }
  if (n > m->size - 8) {
    fail(path, "header length " + std::to_string(n) + " exceeds the " + std::to_string(m->size - 8) +
                   " bytes after the length prefix (truncated file?)");
  }
  m->data = m->base + 8 + n;
  m->data_size = m->size - 8 - n;

  json header;
  try {
    const char* h = reinterpret_cast<const char*>(m->base + 8);
    header = json::parse(h, h + n);
  } catch (const json::exception& e) {
    fail(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header is not a JSON object");

  ParsedFile out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(path, "\"__metadata__\" is not a JSON object");
      for (auto mt = entry.begin(); mt != entry.end(); ++mt) {
        if (!mt.value().is_string()) fail(path, "\"__metadata__\" value of '" + mt.key() + "' is not a string");
        out.metadata[mt.key()] = mt.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) fail(path, name, "header entry is not a JSON object");

    TensorInfo ti;
    ti.name = name;
    ti.file = path;

    auto dt = entry.find("dtype");
    if (dt == entry.end()) fail(path, name, "missing \"dtype\"");
    if (!dt->is_string()) fail(path, name, "\"dtype\" is not a string");
    const std::optional<at::ScalarType> dtype = dtype_from_name(dt->get<std::string>());
    if (!dtype) fail(path, name, "unknown dtype \"" + dt->get<std::string>() + "\"");
    ti.dtype = *dtype;

    auto sh = entry.find("shape");
    if (sh == entry.end()) fail(path, name, "missing \"shape\"");
    if (!sh->is_array()) fail(path, name, "\"shape\" is not an array");
    // numel as the product of the non-zero dims, so a zero-size tensor with huge other dims is judged
    // the way ATen's own overflow check (c10 safe_multiply_u64) judges it.
    uint64_t numel_nonzero = 1;
    bool has_zero = false;
    for (const json& d : *sh) {
      if (d.is_number_integer() && !d.is_number_unsigned() && d.get<int64_t>() < 0) {
        fail(path, name, "negative dimension " + std::to_string(d.get<int64_t>()) + " in \"shape\"");
      }
      const std::optional<uint64_t> dim = as_u64(d);
      if (!dim) fail(path, name, "\"shape\" holds a non-integer: " + d.dump());
      if (*dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(path, name, "dimension " + std::to_string(*dim) + " does not fit int64");
      }
      ti.shape.push_back(static_cast<int64_t>(*dim));
      if (*dim == 0) {
        has_zero = true;
      } else if (__builtin_mul_overflow(numel_nonzero, *dim, &numel_nonzero) ||
                 numel_nonzero > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(path, name, "shape " + sh->dump() + " overflows int64");
      }
    }
    uint64_t nbytes = 0;
    const uint64_t itemsize = c10::elementSize(ti.dtype);
    if (__builtin_mul_overflow(has_zero ? 0 : numel_nonzero, itemsize, &nbytes)) {
      fail(path, name, "shape " + sh->dump() + " overflows the byte count");
    }

    auto off = entry.find("data_offsets");
    if (off == entry.end()) fail(path, name, "missing \"data_offsets\"");
    if (!off->is_array() || off->size() != 2 || !as_u64((*off)[0]) || !as_u64((*off)[1])) {
      fail(path, name, "\"data_offsets\" is not [begin, end] with non-negative integers: " + off->dump());
    }
    ti.begin = *as_u64((*off)[0]);
    ti.end = *as_u64((*off)[1]);
    if (ti.end < ti.begin) fail(path, name, "data_offsets " + off->dump() + " end before begin");
    if (ti.end > m->data_size) {
      fail(path, name,
           "data_offsets " + off->dump() + " run past the end of the file (data buffer is " +
               std::to_string(m->data_size) + " bytes)");
    }
    if (ti.end - ti.begin != nbytes) {
      fail(path, name,
           "data_offsets " + off->dump() + " span " + std::to_string(ti.end - ti.begin) + " bytes, but shape " +
               sh->dump() + " of " + dt->get<std::string>() + " needs " + std::to_string(nbytes));
    }
    out.tensors.emplace(name, std::move(ti));
  }
  out.mapped = std::move(m);
  return out;
}

// The index's shard names are file names relative to its folder; an absolute path or ".." would let an
// index point anywhere on disk.
bool is_plain_relative(const std::string& shard) {
  const fs::path p(shard);
  if (shard.empty() || p.is_absolute()) return false;
  for (const fs::path& part : p) {
    if (part == "..") return false;
  }
  return true;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open: " + errno_text());
  std::ostringstream os;
  os << in.rdbuf();
  if (in.bad()) fail(path, "read failed");
  return os.str();
}

void write_all(int fd, const void* bytes, uint64_t n, const std::string& file) {
  const char* p = static_cast<const char*>(bytes);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<uint64_t>(n, 1u << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(file, "write failed: " + errno_text());
    }
    p += w;
    n -= static_cast<uint64_t>(w);
  }
}

// Runs `body(fd)` on "<file>.tmp", fsyncs it, renames it over `file` and fsyncs the folder. On any
// failure the .tmp file is removed and `file` is left as it was.
void write_atomically(const std::string& file, const std::function<void(int)>& body) {
  const std::string tmp = file + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(file, "cannot create " + tmp + ": " + errno_text());
  try {
    body(fd);
    if (::fsync(fd) != 0) fail(file, "fsync failed: " + errno_text());
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) fail(file, "close failed: " + errno_text());
    if (::rename(tmp.c_str(), file.c_str()) != 0) fail(file, "rename from " + tmp + " failed: " + errno_text());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // Make the rename itself durable; failure here loses nothing already written, so it is not an error.
  std::string parent = fs::path(file).parent_path().string();
  const int dfd = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

uint64_t nbytes_of(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// Name checks shared by write_file and write_checkpoint (the latter checks across shards before writing any).
void check_tensors(const std::string& where, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") fail(where, name, "this name is reserved for the header's metadata");
    if (!seen.insert(name).second) fail(where, name, "duplicate tensor name");
    if (!t.defined()) fail(where, name, "undefined tensor");
    if (dtype_name(t.scalar_type()) == nullptr) {
      fail(where, name, std::string("dtype ") + c10::toString(t.scalar_type()) + " has no safetensors name");
    }
    if (t.is_sparse() || t.is_quantized()) fail(where, name, "only dense tensors can be written");
  }
}

}  // namespace

const char* dtype_name(at::ScalarType dtype) {
  for (const DtypeName& d : kDtypes) {
    if (dtype == d.type) return d.name;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------------------
// Reader

Reader Reader::open(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail(path, "no such file or folder");

  std::string single, index;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    if (fs::exists(dir / kSingleFile)) {
      single = (dir / kSingleFile).string();
    } else if (fs::exists(dir / kIndexFile)) {
      index = (dir / kIndexFile).string();
    } else {
      fail(path, std::string("folder holds neither ") + kSingleFile + " nor " + kIndexFile);
    }
  } else if (path.size() >= 11 && path.compare(path.size() - 11, 11, ".index.json") == 0) {
    index = path;
  } else {
    single = path;
  }

  Reader r;
  r.path_ = path;
  if (!single.empty()) {
    ParsedFile f = parse_file(single);
    r.tensors_ = std::move(f.tensors);
    r.metadata_ = std::move(f.metadata);
    r.files_[single] = std::move(f.mapped);
    return r;
  }

  json idx;
  try {
    idx = json::parse(read_text(index));
  } catch (const json::exception& e) {
    fail(index, std::string("index is not valid JSON: ") + e.what());
  }
  if (!idx.is_object()) fail(index, "index is not a JSON object");
  auto wm = idx.find("weight_map");
  if (wm == idx.end() || !wm->is_object()) fail(index, "index has no \"weight_map\" object");
  const fs::path dir = fs::path(index).parent_path();

  std::map<std::string, ParsedFile> shards;  // by shard path; sorted, so the first is shard 1
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    const std::string& name = it.key();
    if (!it.value().is_string()) fail(index, name, "weight_map value is not a string");
    const std::string shard_name = it.value().get<std::string>();
    if (!is_plain_relative(shard_name)) {
      fail(index, name, "weight_map names \"" + shard_name + "\", not a relative path inside the folder");
    }
    const std::string shard = (dir / shard_name).string();
    auto sit = shards.find(shard);
    if (sit == shards.end()) {
      if (!fs::exists(shard)) fail(index, name, "weight_map names shard " + shard + ", which does not exist");
      sit = shards.emplace(shard, parse_file(shard)).first;
    }
    auto tit = sit->second.tensors.find(name);
    if (tit == sit->second.tensors.end()) fail(shard, name, "not in this shard, though " + index + " names it");
    r.tensors_[name] = tit->second;
  }
  if (!shards.empty()) r.metadata_ = shards.begin()->second.metadata;
  auto md = idx.find("metadata");
  if (md != idx.end() && md->is_object()) {
    for (auto it = md->begin(); it != md->end(); ++it) {
      r.metadata_[it.key()] = it.value().is_string() ? it.value().get<std::string>() : it.value().dump();
    }
  }
  for (auto& [shard, f] : shards) r.files_[shard] = std::move(f.mapped);
  return r;
}

std::vector<std::string> Reader::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

bool Reader::contains(const std::string& name) const { return tensors_.count(name) != 0; }

const TensorInfo& Reader::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, name, "no such tensor in the checkpoint");
  return it->second;
}

at::Tensor Reader::load(const std::string& name) const {
  const TensorInfo& ti = info(name);
  const detail::MappedFile& m = *files_.at(ti.file);
  const uint8_t* src = m.data + ti.begin;  // in bounds: checked by parse_file
  const uint64_t nbytes = ti.end - ti.begin;
  if (ti.dtype == at::kBool) {
    for (uint64_t i = 0; i < nbytes; ++i) {
      if (src[i] > 1) fail(ti.file, name, "BOOL byte " + std::to_string(i) + " is " + std::to_string(src[i]));
    }
  }
  at::Tensor t = at::empty(ti.shape, at::TensorOptions().dtype(ti.dtype));  // shape of ti, contiguous
  if (nbytes > 0) std::memcpy(t.data_ptr(), src, nbytes);
  return t;
}

at::Tensor Reader::load(const std::string& name, at::IntArrayRef shape, at::ScalarType dtype) const {
  const TensorInfo& ti = info(name);
  if (!shape.equals(ti.shape)) {
    fail(ti.file, name,
         "expected shape " + shape_text(shape) + " (" + c10::toString(dtype) + "), found " + shape_text(ti.shape) +
             " (" + c10::toString(ti.dtype) + ")");
  }
  at::Tensor t = load(name);
  if (t.scalar_type() == dtype) return t;
  try {
    return t.to(dtype);
  } catch (const c10::Error& e) {
    fail(ti.file, name,
         std::string("cannot cast ") + c10::toString(ti.dtype) + " to " + c10::toString(dtype) + ": " +
             e.what_without_backtrace());
  }
}

const std::map<std::string, std::string>& Reader::metadata() const { return metadata_; }

// ---------------------------------------------------------------------------------------------------------
// Writing

void write_file(const std::string& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                const std::map<std::string, std::string>& metadata) {
  check_tensors(file, tensors);

  // ordered_json keeps insertion order: "__metadata__" first, then the tensors as given; each entry's keys
  // in the reference's order (dtype, shape, data_offsets).
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t nbytes = nbytes_of(t);
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = dtype_name(t.scalar_type());
    entry["shape"] = t.sizes().vec();
    entry["data_offsets"] = nlohmann::ordered_json::array({offset, offset + nbytes});
    header[name] = std::move(entry);
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();  // compact, as serde_json writes it; UTF-8 left unescaped
  } catch (const nlohmann::json::exception& e) {
    fail(file, std::string("cannot encode the header (tensor or metadata name not UTF-8?): ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();

  write_atomically(file, [&](int fd) {
    write_all(fd, &n, 8, file);
    write_all(fd, text.data(), n, file);
    for (const auto& [name, t] : tensors) {
      // One tensor's CPU copy at a time (none when it is already a contiguous CPU tensor); dropped after.
      const at::Tensor c = t.detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();
      const uint64_t nbytes = nbytes_of(c);
      if (nbytes > 0) write_all(fd, c.data_ptr(), nbytes, file);
    }
  });
}

std::vector<std::string> write_checkpoint(const std::string& dir,
                                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                          uint64_t max_shard_bytes) {
  check_tensors(dir, tensors);  // before any shard is written
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(dir, "cannot create folder: " + ec.message());
  const fs::path d(dir);

  uint64_t total = 0;
  for (const auto& kv : tensors) total += nbytes_of(kv.second);

  if (total <= max_shard_bytes) {
    const std::string file = (d / kSingleFile).string();
    write_file(file, tensors);
    fs::remove(d / kIndexFile, ec);  // stale index of an earlier sharded write; a missing one is fine
    return {file};
  }

  // Greedy split in the given order: a shard is closed when the next tensor would push it past the limit.
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards;
  uint64_t current = 0;
  for (const auto& kv : tensors) {
    const uint64_t nbytes = nbytes_of(kv.second);
    if (shards.empty() || (!shards.back().empty() && current + nbytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(kv);
    current += nbytes;
  }

  std::vector<std::string> written;
  json weight_map = json::object();  // std::map-backed: keys sorted by name
  for (size_t i = 0; i < shards.size(); ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    const std::string file = (d / name).string();
    write_file(file, shards[i]);
    for (const auto& kv : shards[i]) weight_map[kv.first] = name;
    written.push_back(file);
  }

  json index = json::object();
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = std::move(weight_map);
  const std::string index_file = (d / kIndexFile).string();
  const std::string text = index.dump(2) + "\n";
  write_atomically(index_file, [&](int fd) { write_all(fd, text.data(), text.size(), index_file); });
  written.push_back(index_file);
  fs::remove(d / kSingleFile, ec);  // stale single file of an earlier write; Reader would prefer it
  return written;
}

}  // namespace rlt::safetensors
