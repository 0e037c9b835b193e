#include "models/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <new>
#include <stdexcept>
#include <system_error>

namespace tessera::data {
namespace {

// Owns a gzFile; gzopen reads plain files transparently, so one path handles both forms.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path) {
    errno = 0;
    file_ = gzopen(path.c_str(), "rb");
    TS_CHECK(file_ != nullptr, "read_idx: cannot open '{}': {}", path,
             errno ? std::error_code(errno, std::generic_category()).message()
                   : std::string("out of memory"));
    gzbuffer(file_, 1 << 20);  // MNIST's 47 MB of pixels in few, large reads
  }
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; fewer only at the end of the data. A gzip stream cut short reads as
  // an early end, so truncation is reported by the caller's byte count.
  size_t read(void* out, size_t n) {
    size_t total = 0;
    char* p = static_cast<char*>(out);
    while (total < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - total, 1u << 30));
      const int got = gzread(file_, p + total, chunk);
      if (got < 0) check_stream();
      if (got <= 0) break;
      total += static_cast<size_t>(got);
    }
    return total;
  }

  // Throws on a damaged gzip stream; a stream that merely ended early passes (Z_BUF_ERROR).
  void check_stream(bool allow_early_end = true) {
    int err = Z_OK;
    const char* msg = gzerror(file_, &err);
    if (err == Z_OK || (allow_early_end && err == Z_BUF_ERROR)) return;
    fail("read_idx: '{}' is not a readable gzip or IDX file: {}", path_, msg);
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

std::string dims_str(const std::vector<int64_t>& dims) { return shape_str(dims); }

std::string find_file(const std::string& dir, const std::string& base) {
  // Mirrors name the files "x-idx3-ubyte" (LeCun's site) or "x.idx3-ubyte" (some re-uploads).
  std::string dotted = base;
  dotted[dotted.find("-idx")] = '.';
  const std::vector<std::string> candidates = {dir + "/" + base + ".gz", dir + "/" + base,
                                               dir + "/" + dotted + ".gz", dir + "/" + dotted};
  for (const std::string& c : candidates) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(c, ec)) return c;
  }
  fail("load_mnist: no {} or {} in '{}'", base + ".gz", base, dir);
}

}  // namespace

// Function-try-blocks: a file larger than the memory left fails as an Error naming it.
IdxArray read_idx(const std::string& path) try {
  GzReader in(path);
  unsigned char magic[4];
  const size_t got_magic = in.read(magic, 4);
  TS_CHECK(got_magic == 4, "read_idx: '{}' holds {} bytes, too short for the 4-byte IDX magic",
           path, got_magic);
  const uint32_t magic_value = (uint32_t{magic[0]} << 24) | (uint32_t{magic[1]} << 16) |
                               (uint32_t{magic[2]} << 8) | magic[3];
  TS_CHECK(magic[0] == 0 && magic[1] == 0 && magic[3] >= 1,
           "read_idx: '{}' has magic 0x{:08x}; expected 0x000008NN (unsigned bytes, NN dims), "
           "e.g. 0x00000803 for images or 0x00000801 for labels",
           path, magic_value);
  TS_CHECK(magic[2] == 0x08,
           "read_idx: '{}' has element type 0x{:02x} (magic 0x{:08x}); only unsigned bytes "
           "(0x08) are supported",
           path, magic[2], magic_value);

  IdxArray out;
  const int ndims = magic[3];
  std::vector<unsigned char> dim_bytes(4 * ndims);
  const size_t got_dims = in.read(dim_bytes.data(), dim_bytes.size());
  TS_CHECK(got_dims == dim_bytes.size(),
           "read_idx: '{}' is truncated in its header: {} dims need {} bytes, got {}", path, ndims,
           dim_bytes.size(), got_dims);
  int64_t expected = 1;
  for (int d = 0; d < ndims; ++d) {
    const unsigned char* b = &dim_bytes[4 * d];
    const int64_t dim = (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
    out.dims.push_back(dim);
    TS_CHECK(!__builtin_mul_overflow(expected, dim, &expected),
             "read_idx: '{}' has dims {} whose product overflows", path, dims_str(out.dims));
  }
  // A zero dim beside huge ones holds no data but would wrap a tensor's strides.
  try {
    storage_bytes("read_idx", out.dims, 1);
  } catch (const Error& e) {
    fail("read_idx: '{}' has dims {} that no tensor can hold: {}", path, dims_str(out.dims),
         e.what());
  }

  // Grow while reading, so a header claiming terabytes fails on truncation, not allocation.
  constexpr size_t kChunk = size_t{64} << 20;
  size_t have = 0;
  while (have < static_cast<size_t>(expected)) {
    const size_t want = std::min(kChunk, static_cast<size_t>(expected) - have);
    out.data.resize(have + want);
    const size_t got = in.read(out.data.data() + have, want);
    have += got;
    if (got < want) break;
  }
  in.check_stream();
  TS_CHECK(have == static_cast<size_t>(expected),
           "read_idx: '{}' is truncated: dims {} need {} data bytes, got {}", path,
           dims_str(out.dims), expected, have);
  out.data.resize(have);

  size_t trailing = 0;
  char scratch[4096];
  for (size_t got; (got = in.read(scratch, sizeof(scratch))) > 0;) trailing += got;
  in.check_stream(/*allow_early_end=*/false);
  TS_CHECK(trailing == 0, "read_idx: '{}' has {} extra bytes after the {} data bytes of dims {}",
           path, trailing, expected, dims_str(out.dims));
  return out;
} catch (const std::bad_alloc&) {
  fail("read_idx: out of memory reading '{}'", path);
} catch (const std::length_error&) {
  fail("read_idx: '{}' is too large to hold in memory", path);
}

MnistSplit load_mnist(const std::string& dir, bool train, double mean, double std,
                      int64_t limit) try {
  TS_CHECK(std > 0, "load_mnist: std must be positive, got {}", std);
  TS_CHECK(limit >= -1, "load_mnist: limit must be -1 (all) or >= 0, got {}", limit);
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");
  const IdxArray images = read_idx(images_path);
  const IdxArray labels = read_idx(labels_path);
  TS_CHECK(images.dims.size() == 3,
           "load_mnist: '{}' should hold images (magic 0x00000803, dims [N, rows, cols]), "
           "got dims {}",
           images_path, dims_str(images.dims));
  TS_CHECK(labels.dims.size() == 1,
           "load_mnist: '{}' should hold labels (magic 0x00000801, dims [N]), got dims {}",
           labels_path, dims_str(labels.dims));
  TS_CHECK(images.dims[0] == labels.dims[0], "load_mnist: {} images in '{}' but {} labels in '{}'",
           images.dims[0], images_path, labels.dims[0], labels_path);

  const int64_t n = limit < 0 ? images.dims[0] : std::min(limit, images.dims[0]);
  const int64_t rows = images.dims[1], cols = images.dims[2];
  MnistSplit out;
  out.images = Tensor::empty({n, 1, rows, cols}, DType::f32);
  out.labels = Tensor::empty({n}, DType::i64);

  // 256 possible pixels: one table, computed in f64 and rounded once.
  float table[256];
  for (int v = 0; v < 256; ++v) table[v] = static_cast<float>((v / 255.0 - mean) / std);
  float* pixels = out.images.data<float>();
  const int64_t count = n * rows * cols;
  for (int64_t i = 0; i < count; ++i) pixels[i] = table[images.data[i]];

  // Every label is checked, not only the kept ones: a bad one means a damaged file.
  for (size_t i = 0; i < labels.data.size(); ++i) {
    TS_CHECK(labels.data[i] < 10, "load_mnist: '{}' has label {} at index {}; expected 0..9",
             labels_path, labels.data[i], i);
  }
  int64_t* label = out.labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) label[i] = labels.data[i];
  return out;
} catch (const std::bad_alloc&) {
  fail("load_mnist: out of memory loading the {} split from '{}'", train ? "training" : "test",
       dir);
}

}  // namespace tessera::data
