// Byte-level text for the GPT example: a corpus of files read as raw bytes (vocab 256), a
// fixed 90/10 train/val split, and seeded random context windows that data-parallel ranks
// slice without changing the global batch.
//
//   TextCorpus corpus = load_text(kFortunesDir);        // or a file / directory of --data
//   TextWindows train(corpus, TextSplit::train, /*seed=*/1);
//   TextBatch b = train.get(step, /*batch=*/32, /*context=*/128);   // idx, targets: i64 [32, 128]
//   TextBatch mine = train.get(step, 32, 128, rank, world);        // rows [r*32/w, (r+1)*32/w)
//
// A window's start is a pure function of (seed, split, step, global row), so the rows ranks
// draw, concatenated in rank order, are exactly the world = 1 batch, and (step) is all a
// checkpoint needs to resume the data stream.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::data {

// Where tools/setup.sh installs Debian's fortunes package (text files, each with a binary
// *.dat index beside it and a *.u8 symlink to it).
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

// The size of a byte-level vocabulary: token = byte value.
inline constexpr int64_t kByteVocab = 256;

// The fraction of the concatenated bytes that goes to the training split.
inline constexpr double kTrainFraction = 0.9;

struct TextFile {
  std::string path;
  int64_t bytes = 0;
};

struct TextCorpus {
  std::vector<uint8_t> bytes;   // the files' contents, concatenated in `files` order
  std::vector<TextFile> files;  // sorted by path
};

// Reads `path` as raw bytes. A regular file (or a symlink to one) is read whatever its name
// or contents: naming it is asking for it. A directory is walked recursively without
// following symlinks, and keeps the regular files that
//   - are not symlinks (fortunes' *.u8 links would double the text),
//   - do not end in ".dat" (fortunes' binary strfile indexes),
//   - do not look binary: no NUL byte in their first 8000 bytes (git's heuristic),
// sorted by their path's bytes so the concatenation is the same on every machine. Files are
// joined as they are (fortunes files end in a newline; nothing is inserted between files).
// Throws Error naming the path when it does not exist, cannot be read, or yields no bytes.
TextCorpus load_text(const std::string& path = kFortunesDir);

enum class TextSplit : uint8_t { train = 0, val = 1 };
const char* split_name(TextSplit split);

// Bytes [0, split_point(n)) are the training split and [split_point(n), n) the validation
// split, with split_point(n) = floor(kTrainFraction * n): one cut of the concatenation (not a
// per-file split), so validation text is the tail of the last files in path order.
int64_t split_point(int64_t num_bytes);
std::vector<uint8_t> split_bytes(const TextCorpus& corpus, TextSplit split);

struct TextBatch {
  Tensor idx;      // i64 [rows, context], CPU, each in [0, 256)
  Tensor targets;  // i64 [rows, context]: targets[r][t] = the byte after idx[r][t]
};

// Context windows over the bytes of one split.
class TextWindows {
 public:
  TextWindows(const TextCorpus& corpus, TextSplit split, uint64_t seed = 0);
  // Over given bytes; `split` only selects the random stream (train and val windows with
  // one seed are independent draws).
  TextWindows(std::vector<uint8_t> bytes, TextSplit split, uint64_t seed = 0);

  // The rows of rank `rank` (of `world`) of the global batch `batch` at `step`: global rows
  // [rank * batch / world, (rank + 1) * batch / world). Global row i starts at a uniform
  // integer in [0, size() - context - 1] drawn by Philox keyed by the seed at counter
  // split << 63 | step << 32 | i, so it depends on nothing else (not the rank or world).
  // Errors: batch <= 0, batch % world != 0, rank outside [0, world), context <= 0 or
  // context >= size(), step outside [0, 2^31), batch >= 2^32.
  TextBatch get(int64_t step, int64_t batch, int64_t context, int rank = 0, int world = 1) const;

  // Deterministic evaluation: the split cut into consecutive, non-overlapping windows
  // (window j starts at j * context), batch of them per index, the last partial batch
  // dropped so every batch (and every rank's slice) has one shape. eval_batch slices ranks
  // like get(). Together the eval batches score each covered byte once.
  int64_t num_eval_batches(int64_t batch, int64_t context) const;
  TextBatch eval_batch(int64_t index, int64_t batch, int64_t context, int rank = 0,
                       int world = 1) const;

  // The start of global row i of the batch at `step` for windows of `context` (what get()
  // uses; exposed for tests and inspection).
  int64_t window_start(int64_t step, int64_t row, int64_t context) const;

  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }
  TextSplit split() const { return split_; }
  uint64_t seed() const { return seed_; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }

 private:
  // Rows [first, first + rows) of a batch whose row i starts at start(i).
  template <typename StartOf>
  TextBatch gather(int64_t first, int64_t rows, int64_t context, StartOf start) const;

  std::vector<uint8_t> bytes_;
  TextSplit split_;
  uint64_t seed_;
};

}  // namespace tessera::data
