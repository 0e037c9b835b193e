// Counter-based random numbers (Philox-4x32-10). Element i of a tensor drawn at
// (seed, offset) uses counter offset + i, so its value is a pure function of
// (seed, offset + i): the same on any device and for any slicing or sharding of the tensor.
//
//   manual_seed(42);
//   Tensor a = rand({4, 8});                 // draws at this thread's (seed, offset)
//   Generator g(42); Tensor b = randn({16}, DType::f32, kCPU, &g);
//
// Each thread has its own default generator (each simulated rank is a thread), so ranks
// that seed alike and draw alike see the same numbers.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

namespace tessera {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) { seed_ = seed; offset_ = offset; }
  // Reserves n counters and returns the first.
  uint64_t advance(uint64_t n) {
    const uint64_t first = offset_;
    offset_ += n;
    return first;
  }

 private:
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

Generator& default_generator();  // this thread's
void manual_seed(uint64_t seed);  // resets this thread's generator to (seed, 0)

// The rows of the global batch this thread's forward runs (a data-parallel rank's slice, a
// micro-batch). Inside a BatchSliceScope, dropout (tensor/ops.h) on an input leading with
// `rows` rows draws rows [start, start + rows) of the mask of the global input (`global_rows`
// rows), and the generator advances by the global element count: every element's mask is
// the one a single device running the whole batch draws, whatever the split.
struct BatchSlice {
  int64_t global_rows = 0, start = 0, rows = 0;
};
class BatchSliceScope {
 public:
  explicit BatchSliceScope(BatchSlice slice);  // Error unless 0 <= start, start + rows <= global
  // The slice `slice` points to, or (null) none: a replay of code that ran under
  // current_batch_slice() (activation recomputation) installs what it saw.
  explicit BatchSliceScope(const BatchSlice* slice);
  ~BatchSliceScope();
  BatchSliceScope(const BatchSliceScope&) = delete;
  BatchSliceScope& operator=(const BatchSliceScope&) = delete;

 private:
  const BatchSlice* previous_;
  BatchSlice slice_;
};
// This thread's innermost slice; null outside every scope.
const BatchSlice* current_batch_slice();

namespace philox {

using Block = std::array<uint32_t, 4>;

// Philox-4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
constexpr Block philox4x32(uint64_t counter, uint64_t key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  Block c = {static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u};
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<uint32_t>(p0)};
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return c;
}

// Uniform in [0, 1) with 24 random bits (exactly representable in f32).
constexpr float uniform(uint64_t seed, uint64_t counter) {
  return static_cast<float>(philox4x32(counter, seed)[0] >> 8) * (1.0f / 16777216.0f);
}

// Uniform in [0, 1) with 53 random bits, for f64 tensors.
constexpr double uniform_f64(uint64_t seed, uint64_t counter) {
  const Block b = philox4x32(counter, seed);
  const uint64_t bits = ((static_cast<uint64_t>(b[0]) << 32) | b[1]) >> 11;
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

// Standard normal by Box-Muller on two words of the element's block.
inline double normal(uint64_t seed, uint64_t counter) {
  const Block b = philox4x32(counter, seed);
  const uint64_t w0 = ((static_cast<uint64_t>(b[0]) << 32) | b[1]) >> 11;
  const uint64_t w1 = ((static_cast<uint64_t>(b[2]) << 32) | b[3]) >> 11;
  const double u1 = (static_cast<double>(w0) + 1.0) * (1.0 / 9007199254740993.0);  // (0, 1]
  const double u2 = static_cast<double>(w1) * (1.0 / 9007199254740992.0);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace philox
}  // namespace tessera
