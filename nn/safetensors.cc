#include "nn/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <system_error>
#include <vector>

namespace tessera::nn {
namespace {

// The format is little-endian; on x86/ARM hosts the bytes in memory are the bytes on disk.
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian: add byte swapping for big-endian hosts");

using json = nlohmann::json;

// The reference implementation refuses headers above 100 MB; a larger length is corruption.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"}, {DType::f64, "F64"}, {DType::f16, "F16"}, {DType::bf16, "BF16"},
    {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::b8, "BOOL"}, {DType::u8, "U8"},
};

bool dtype_from_safetensors(const std::string& name, DType* out) {
  for (const DTypeName& d : kDTypeNames) {
    if (name == d.name) {
      *out = d.dtype;
      return true;
    }
  }
  return false;
}

// Closes on scope exit; the error paths below throw with the descriptor still open.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Returns close()'s errno (0 on success): on NFS a failed write can surface only here.
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

void write_all(int fd, const void* data, size_t n, const std::string& tmp_path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(n, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("save_safetensors: writing '{}' failed: {}", tmp_path, errno_text(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// Reads exactly n bytes at `offset`; a short read means the file changed under us.
void read_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r =
        ::pread(fd, p, std::min<size_t>(n, size_t{1} << 30), static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      fail("load_safetensors: reading '{}' failed: {}", path, errno_text(errno));
    }
    if (r == 0)
      fail("load_safetensors: '{}' ended early at byte {} (modified while reading?)", path, offset);
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

std::string header_json(const std::map<std::string, Tensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    json shape = json::array();
    for (int64_t d : t.shape()) shape.push_back(d);
    const uint64_t nbytes = static_cast<uint64_t>(t.nbytes());
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                    {"shape", std::move(shape)},
                    {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  // Readers treat a missing __metadata__ as empty; PyTorch's writer also omits it then.
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    fail("save_safetensors: tensor names and metadata must be valid UTF-8: {}", e.what());
  }
  // Padding to 8 bytes keeps every tensor's data 8-byte aligned for readers that mmap.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

void write_tensor_data(int fd, const Tensor& t, const std::string& tmp_path) {
  if (t.numel() == 0) return;
  if (t.device().is_cpu() && t.is_contiguous()) {
    write_all(fd, t.raw_data(), static_cast<size_t>(t.nbytes()), tmp_path);
    return;
  }
  std::vector<char> host(static_cast<size_t>(t.nbytes()));
  copy_to_host(t, t.dtype(), host.data());
  write_all(fd, host.data(), host.size(), tmp_path);
}

// Makes a completed rename durable; best effort, since the data itself is already synced.
void sync_parent_directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
};

Entry parse_entry(const std::string& path, const std::string& name, const json& info) {
  TS_CHECK(info.is_object(), "load_safetensors: '{}': tensor '{}' must be a JSON object, got {}",
           path, name, info.type_name());
  for (const auto& [key, value] : info.items()) {
    TS_CHECK(key == "dtype" || key == "shape" || key == "data_offsets",
             "load_safetensors: '{}': tensor '{}' has unknown field '{}' (expected dtype, "
             "shape, data_offsets)",
             path, name, key);
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    TS_CHECK(info.contains(field), "load_safetensors: '{}': tensor '{}' is missing field '{}'",
             path, name, field);
  }
  Entry e;
  e.name = name;
  const json& dtype = info["dtype"];
  TS_CHECK(dtype.is_string(), "load_safetensors: '{}': tensor '{}' dtype must be a string, got {}",
           path, name, dtype.dump());
  TS_CHECK(dtype_from_safetensors(dtype.get<std::string>(), &e.dtype),
           "load_safetensors: '{}': tensor '{}' has dtype '{}', which Tessera does not support "
           "(F32, F64, F16, BF16, I32, I64, BOOL, U8)",
           path, name, dtype.get<std::string>());

  const json& shape = info["shape"];
  TS_CHECK(shape.is_array(), "load_safetensors: '{}': tensor '{}' shape must be an array, got {}",
           path, name, shape.dump());
  int64_t numel = 1;
  for (const json& d : shape) {
    TS_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t{1} << 62,
             "load_safetensors: '{}': tensor '{}' shape {} must hold non-negative integers", path,
             name, shape.dump());
    const int64_t dim = d.get<int64_t>();
    TS_CHECK(!__builtin_mul_overflow(numel, dim, &numel),
             "load_safetensors: '{}': tensor '{}' shape {} overflows int64", path, name,
             shape.dump());
    e.shape.push_back(dim);
  }
  // The bytes, checked as a tensor's: a zero dim beside huge ones holds no bytes but would
  // wrap the tensor's strides.
  int64_t nbytes = 0;
  try {
    nbytes = storage_bytes("load_safetensors", e.shape, dtype_size(e.dtype));
  } catch (const Error& err) {
    fail("load_safetensors: '{}': tensor '{}' shape {} cannot be a tensor: {}", path, name,
         shape.dump(), err.what());
  }

  const json& offsets = info["data_offsets"];
  TS_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
               offsets[1].is_number_unsigned(),
           "load_safetensors: '{}': tensor '{}' data_offsets must be [begin, end] with "
           "non-negative integers, got {}",
           path, name, offsets.dump());
  e.begin = offsets[0].get<uint64_t>();
  e.end = offsets[1].get<uint64_t>();
  TS_CHECK(e.begin <= e.end,
           "load_safetensors: '{}': tensor '{}' data_offsets [{}, {}] end "
           "before they begin",
           path, name, e.begin, e.end);
  TS_CHECK(e.end - e.begin == static_cast<uint64_t>(nbytes),
           "load_safetensors: '{}': tensor '{}' (dtype {}, shape {}) needs {} bytes but "
           "data_offsets [{}, {}] span {}",
           path, name, dtype.get<std::string>(), shape_str(e.shape), nbytes, e.begin, e.end,
           e.end - e.begin);
  return e;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& meta) {
  TS_CHECK(meta.is_object(),
           "load_safetensors: '{}': __metadata__ must be an object of "
           "strings, got {}",
           path, meta.type_name());
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : meta.items()) {
    TS_CHECK(value.is_string(),
             "load_safetensors: '{}': __metadata__ value for '{}' must be a "
             "string, got {}",
             path, key, value.dump());
    out[key] = value.get<std::string>();
  }
  return out;
}

// Sorted by position, the ranges must tile [0, data_bytes) exactly, as the reference reader
// demands: anything else is overlap, a gap, truncation or trailing garbage.
void check_layout(const std::string& path, std::vector<Entry>& entries, uint64_t data_bytes) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  const Entry* previous = nullptr;
  for (const Entry& e : entries) {
    TS_CHECK(e.begin >= expected,
             "load_safetensors: '{}': tensor '{}' data_offsets [{}, {}] overlap tensor '{}' "
             "ending at {}",
             path, e.name, e.begin, e.end, previous ? previous->name : "", expected);
    TS_CHECK(e.begin == expected,
             "load_safetensors: '{}': tensor '{}' data_offsets [{}, {}] leave a gap after byte "
             "{}; tensors must be stored back to back",
             path, e.name, e.begin, e.end, expected);
    TS_CHECK(e.end <= data_bytes,
             "load_safetensors: '{}': tensor '{}' data_offsets [{}, {}] run past the {} data "
             "bytes in the file (truncated?)",
             path, e.name, e.begin, e.end, data_bytes);
    expected = e.end;
    previous = &e;
  }
  TS_CHECK(expected == data_bytes,
           "load_safetensors: '{}': {} trailing bytes after the last tensor's data (the header "
           "describes {} data bytes, the file holds {})",
           path, data_bytes - expected, expected, data_bytes);
}

}  // namespace

std::string safetensors_dtype_name(DType dtype) {
  for (const DTypeName& d : kDTypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  fail("safetensors_dtype_name: invalid dtype {}", static_cast<int>(dtype));
}

void write_safetensors_file(const std::string& tmp_path,
                            const std::map<std::string, Tensor>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  // Validate before touching the disk so bad input never leaves a temp file behind.
  for (const auto& [name, t] : tensors) {
    TS_CHECK(name != "__metadata__",
             "save_safetensors: '{}': '__metadata__' is reserved and cannot name a tensor",
             tmp_path);
    TS_CHECK(t.defined(), "save_safetensors: '{}': tensor '{}' is undefined", tmp_path, name);
  }
  const std::string header = header_json(tensors, metadata);
  Fd fd(::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  TS_CHECK(fd.get() >= 0, "save_safetensors: cannot create '{}': {}", tmp_path,
           errno_text(errno));
  try {
    unsigned char length[8];
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
    write_all(fd.get(), length, 8, tmp_path);
    write_all(fd.get(), header.data(), header.size(), tmp_path);
    for (const auto& [name, t] : tensors) write_tensor_data(fd.get(), t, tmp_path);
    TS_CHECK(::fsync(fd.get()) == 0, "save_safetensors: fsync of '{}' failed: {}", tmp_path,
             errno_text(errno));
    const int close_err = fd.close();
    TS_CHECK(close_err == 0, "save_safetensors: closing '{}' failed: {}", tmp_path,
             errno_text(close_err));
  } catch (const std::bad_alloc&) {
    ::unlink(tmp_path.c_str());
    fail("save_safetensors: out of memory writing '{}'", tmp_path);
  } catch (...) {
    ::unlink(tmp_path.c_str());
    throw;
  }
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string tmp_path = fmt::format("{}.tmp.{}", path, ::getpid());
  write_safetensors_file(tmp_path, tensors, metadata);
  if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_path.c_str());
    fail("save_safetensors: cannot rename '{}' to '{}': {}", tmp_path, path, errno_text(err));
  }
  sync_parent_directory(path);
}

namespace {

// The validated header of an open file: metadata, entries and where the data starts.
struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  uint64_t data_start = 0;
};

Header read_header(int fd, const std::string& path) {
  struct stat st;
  TS_CHECK(::fstat(fd, &st) == 0, "load_safetensors: cannot stat '{}': {}", path,
           errno_text(errno));
  TS_CHECK(S_ISREG(st.st_mode), "load_safetensors: '{}' is not a regular file", path);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  TS_CHECK(file_bytes >= 8,
           "load_safetensors: '{}' is {} bytes, too short for the 8-byte header length", path,
           file_bytes);

  unsigned char length[8];
  read_all(fd, length, 8, 0, path);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= static_cast<uint64_t>(length[i]) << (8 * i);
  TS_CHECK(header_bytes <= file_bytes - 8,
           "load_safetensors: '{}': header length {} exceeds the {} bytes after the length "
           "field (truncated, or not a safetensors file)",
           path, header_bytes, file_bytes - 8);
  TS_CHECK(header_bytes <= kMaxHeaderBytes,
           "load_safetensors: '{}': header length {} is above the format's limit of {} bytes", path,
           header_bytes, kMaxHeaderBytes);

  std::string text(header_bytes, '\0');
  read_all(fd, text.data(), text.size(), 8, path);
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    fail("load_safetensors: '{}': header is not valid JSON: {}", path, e.what());
  }
  TS_CHECK(header.is_object(), "load_safetensors: '{}': header must be a JSON object, got {}", path,
           header.type_name());

  Header out;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      out.metadata = parse_metadata(path, info);
    } else {
      out.entries.push_back(parse_entry(path, name, info));
    }
  }
  out.data_start = 8 + header_bytes;
  check_layout(path, out.entries, file_bytes - out.data_start);
  return out;
}

}  // namespace

SafetensorsFile load_safetensors(const std::string& path) try {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TS_CHECK(fd.get() >= 0, "load_safetensors: cannot open '{}': {}", path, errno_text(errno));
  Header header = read_header(fd.get(), path);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  for (const Entry& e : header.entries) {
    Tensor t;
    try {
      t = Tensor::empty(e.shape, e.dtype, kCPU);
    } catch (const Error& err) {
      fail("load_safetensors: '{}': tensor '{}' ({} {}) cannot be allocated: {}", path, e.name,
           safetensors_dtype_name(e.dtype), shape_str(e.shape), err.what());
    }
    const size_t nbytes = static_cast<size_t>(e.end - e.begin);
    if (nbytes > 0) read_all(fd.get(), t.raw_data(), nbytes, header.data_start + e.begin, path);
    if (e.dtype == DType::b8) {
      // Tessera's bool kernels assume 0/1 bytes; anything else would compare unequal to true.
      const auto* bytes = static_cast<const unsigned char*>(t.raw_data());
      for (size_t i = 0; i < nbytes; ++i) {
        TS_CHECK(bytes[i] <= 1,
                 "load_safetensors: '{}': tensor '{}' (BOOL) holds byte {} at "
                 "element {}; expected 0 or 1",
                 path, e.name, bytes[i], i);
      }
    }
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
} catch (const std::bad_alloc&) {
  fail("load_safetensors: out of memory reading '{}'", path);
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) try {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TS_CHECK(fd.get() >= 0, "load_safetensors: cannot open '{}': {}", path, errno_text(errno));
  return read_header(fd.get(), path).metadata;
} catch (const std::bad_alloc&) {
  fail("load_safetensors: out of memory reading the header of '{}'", path);
}

}  // namespace tessera::nn
