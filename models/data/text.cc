#include "models/data/text.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "tensor/random.h"

namespace tessera::data {
namespace fs = std::filesystem;
namespace {

// git's rule for "binary": a NUL byte among the first 8000.
constexpr size_t kBinarySniffBytes = 8000;

bool looks_binary(const std::vector<uint8_t>& bytes) {
  const size_t n = std::min(bytes.size(), kBinarySniffBytes);
  return std::find(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n), 0) !=
         bytes.begin() + static_cast<std::ptrdiff_t>(n);
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TS_CHECK(in.is_open(), "load_text: cannot open {}", path);
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  TS_CHECK(!in.bad(), "load_text: error while reading {}", path);
  return bytes;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The regular, non-.dat, non-symlink files under `dir`, recursively, sorted by path.
std::vector<std::string> list_text_files(const std::string& dir) {
  std::vector<std::string> paths;
  std::error_code ec;
  // Default options: directory symlinks are not followed, so no cycles and no duplicates.
  fs::recursive_directory_iterator it(dir, ec), end;
  TS_CHECK(!ec, "load_text: cannot list directory {}: {}", dir, ec.message());
  for (; it != end; it.increment(ec)) {
    TS_CHECK(!ec, "load_text: cannot list directory {}: {}", dir, ec.message());
    const fs::file_status link_status = it->symlink_status(ec);
    TS_CHECK(!ec, "load_text: cannot stat {}: {}", it->path().string(), ec.message());
    if (!fs::is_regular_file(link_status)) continue;  // dirs, symlinks, devices, fifos
    const std::string path = it->path().string();
    if (ends_with(path, ".dat")) continue;
    paths.push_back(path);
  }
  TS_CHECK(!ec, "load_text: cannot list directory {}: {}", dir, ec.message());
  std::sort(paths.begin(), paths.end());
  return paths;
}

}  // namespace

// A function-try-block: a corpus larger than the memory left (or than a --memory_limit's
// address space) fails as an Error naming the path, not as std::bad_alloc.
TextCorpus load_text(const std::string& path) try {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);  // follows a symlink named directly
  TS_CHECK(fs::exists(status), "load_text: {} does not exist{}", path,
           ec && ec != std::errc::no_such_file_or_directory ? " (" + ec.message() + ")" : "");
  TextCorpus corpus;
  auto append = [&](const std::string& file, std::vector<uint8_t> bytes) {
    corpus.files.push_back({file, static_cast<int64_t>(bytes.size())});
    corpus.bytes.insert(corpus.bytes.end(), bytes.begin(), bytes.end());
  };
  if (fs::is_directory(status)) {
    int64_t skipped_binary = 0;
    for (const std::string& file : list_text_files(path)) {
      std::vector<uint8_t> bytes = read_file(file);
      if (looks_binary(bytes)) {
        ++skipped_binary;
        continue;
      }
      append(file, std::move(bytes));
    }
    TS_CHECK(!corpus.bytes.empty(),
             "load_text: no text in directory {} ({} text files, {} skipped as binary; *.dat "
             "files and symlinks are skipped too)",
             path, corpus.files.size(), skipped_binary);
  } else {
    TS_CHECK(fs::is_regular_file(status), "load_text: {} is neither a regular file nor a directory",
             path);
    append(path, read_file(path));
    TS_CHECK(!corpus.bytes.empty(), "load_text: {} is empty", path);
  }
  return corpus;
} catch (const std::bad_alloc&) {
  fail("load_text: out of memory reading {}", path);
} catch (const std::length_error&) {
  fail("load_text: {} is too large to hold in memory", path);
}

const char* split_name(TextSplit split) { return split == TextSplit::train ? "train" : "val"; }

int64_t split_point(int64_t num_bytes) {
  return static_cast<int64_t>(std::floor(kTrainFraction * static_cast<double>(num_bytes)));
}

std::vector<uint8_t> split_bytes(const TextCorpus& corpus, TextSplit split) {
  const auto cut = corpus.bytes.begin() + split_point(static_cast<int64_t>(corpus.bytes.size()));
  return split == TextSplit::train ? std::vector<uint8_t>(corpus.bytes.begin(), cut)
                                   : std::vector<uint8_t>(cut, corpus.bytes.end());
}

TextWindows::TextWindows(const TextCorpus& corpus, TextSplit split, uint64_t seed)
    : TextWindows(split_bytes(corpus, split), split, seed) {}

TextWindows::TextWindows(std::vector<uint8_t> bytes, TextSplit split, uint64_t seed)
    : bytes_(std::move(bytes)), split_(split), seed_(seed) {
  TS_CHECK(bytes_.size() >= 2, "TextWindows: the {} split holds {} bytes; need at least 2",
           split_name(split_), bytes_.size());
}

namespace {

void check_context(const char* op, int64_t context, int64_t size, TextSplit split) {
  TS_CHECK(context > 0 && context < size,
           "{}: context {} must be in [1, {}) (the {} split holds {} bytes, and a window "
           "needs context + 1 of them)",
           op, context, size, split_name(split), size);
}

// The first global row and the row count of `rank`'s slice.
std::pair<int64_t, int64_t> rank_rows(const char* op, int64_t batch, int rank, int world) {
  TS_CHECK(batch > 0, "{}: batch must be positive, got {}", op, batch);
  TS_CHECK(world > 0, "{}: world must be positive, got {}", op, world);
  TS_CHECK(rank >= 0 && rank < world, "{}: rank {} outside [0, {})", op, rank, world);
  TS_CHECK(batch % world == 0,
           "{}: global batch {} is not divisible by world {}; every rank needs the same "
           "number of rows",
           op, batch, world);
  const int64_t rows = batch / world;
  return {rank * rows, rows};
}

}  // namespace

int64_t TextWindows::window_start(int64_t step, int64_t row, int64_t context) const {
  check_context("TextWindows::window_start", context, size(), split_);
  // Counter layout: split in bit 63, step in bits 32..62, row in bits 0..31.
  TS_CHECK(step >= 0 && step < (int64_t{1} << 31), "TextWindows: step {} outside [0, 2^31)", step);
  TS_CHECK(row >= 0 && row < (int64_t{1} << 32), "TextWindows: row {} outside [0, 2^32)", row);
  const uint64_t counter = (static_cast<uint64_t>(split_) << 63) |
                           (static_cast<uint64_t>(step) << 32) | static_cast<uint64_t>(row);
  const philox::Block r = philox::philox4x32(counter, seed_);
  const uint64_t x = (static_cast<uint64_t>(r[0]) << 32) | r[1];
  const uint64_t starts = static_cast<uint64_t>(size() - context);  // [0, size - context - 1]
  // Uniform by multiply-high (Lemire); the bias is below starts / 2^64.
  return static_cast<int64_t>((static_cast<unsigned __int128>(x) * starts) >> 64);
}

template <typename StartOf>
TextBatch TextWindows::gather(int64_t first, int64_t rows, int64_t context, StartOf start) const {
  TextBatch out;
  out.idx = Tensor::empty({rows, context}, DType::i64, kCPU);
  out.targets = Tensor::empty({rows, context}, DType::i64, kCPU);
  int64_t* idx = out.idx.data<int64_t>();
  int64_t* targets = out.targets.data<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = start(first + r);
    const uint8_t* window = bytes_.data() + s;  // s + context + 1 <= size(): callers' bounds
    for (int64_t t = 0; t < context; ++t) {
      idx[r * context + t] = window[t];
      targets[r * context + t] = window[t + 1];
    }
  }
  return out;
}

TextBatch TextWindows::get(int64_t step, int64_t batch, int64_t context, int rank,
                           int world) const {
  const auto [first, rows] = rank_rows("TextWindows::get", batch, rank, world);
  check_context("TextWindows::get", context, size(), split_);
  TS_CHECK(step >= 0 && step < (int64_t{1} << 31), "TextWindows::get: step {} outside [0, 2^31)",
           step);
  TS_CHECK(batch < (int64_t{1} << 32), "TextWindows::get: batch {} exceeds 2^32", batch);
  return gather(first, rows, context,
                [&](int64_t row) { return window_start(step, row, context); });
}

int64_t TextWindows::num_eval_batches(int64_t batch, int64_t context) const {
  check_context("TextWindows::num_eval_batches", context, size(), split_);
  TS_CHECK(batch > 0, "TextWindows::num_eval_batches: batch must be positive, got {}", batch);
  // Window j needs bytes [j * context, (j + 1) * context] (its targets reach one further).
  const int64_t windows = (size() - 1) / context;
  return windows / batch;
}

TextBatch TextWindows::eval_batch(int64_t index, int64_t batch, int64_t context, int rank,
                                  int world) const {
  const auto [first, rows] = rank_rows("TextWindows::eval_batch", batch, rank, world);
  const int64_t count = num_eval_batches(batch, context);
  TS_CHECK(index >= 0 && index < count,
           "TextWindows::eval_batch: index {} outside [0, {}) (batch {}, context {}, {} "
           "bytes in the {} split)",
           index, count, batch, context, size(), split_name(split_));
  return gather(first, rows, context, [&](int64_t row) { return (index * batch + row) * context; });
}

}  // namespace tessera::data
