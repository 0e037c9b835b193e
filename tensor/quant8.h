// Block-wise 8-bit quantization of optimizer state (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", 2022): the two dynamic maps, and where a value falls on them.
// The fused adamw8bit_ op (tensor/ops.h) and optim::AdamW8bit use these; kernels on every
// device read the same tables.
//
//   const Quant8Map& m = quant8_map(Quant8Kind::signed_dynamic);
//   uint8_t c = m.code(x / absmax);     // nearest entry (ties to the larger)
//   float y = m.values[c] * absmax;     // dequantized
//
// A tensor's elements are cut into blocks of kQuant8Block consecutive elements (the last may
// be shorter); each block stores its absmax (largest |x|) and one code per element: the
// index of the map entry nearest x / absmax.
//
// The maps: 256 values in [-1, 1] sorted ascending, the code being the index. The dynamic
// ("tree") type spends its bits on a decimal exponent first: after the sign, E zero bits
// give the scale 10^-E, a 1 bit ends the exponent, and the remaining F bits are a linear
// fraction: the midpoints of 2^F equal steps of [0.1, 1]. A value is then
//   10^-E * (0.1 + 0.9 * (j + 1/2) / 2^F),  j in [0, 2^F).
//   signed_dynamic (the first moment): a sign bit, E in 0..6 and F = 6 - E, both signs:
//     2 x 127 values; plus 0 (all bits zero) and 1 (the pattern "minus zero"): 256.
//   unsigned_dynamic (the second moment, never negative): the sign bit becomes one more
//     fraction bit, F = 7 - E: 254 values; plus 0 and 1: 256.
// (These are bitsandbytes' create_dynamic_map(signed) tables; Tessera computes each value in
// f64 and rounds it to f32 once.)
#pragma once

#include <array>
#include <cstdint>

namespace tessera {

inline constexpr int64_t kQuant8Block = 256;

enum class Quant8Kind : uint8_t { signed_dynamic, unsigned_dynamic };

struct Quant8Map {
  std::array<float, 256> values;  // ascending
  // thresholds[k]: the smallest f32 >= the exact midpoint of values[k] and values[k + 1]
  // (k < 255); thresholds[255] = +inf. For any finite f32 x, the nearest value (ties to the
  // larger) is values[#{k : thresholds[k] <= x}], and the count is a branch-free binary
  // search (code()). f64 inputs compare against mid64, the exact midpoints.
  std::array<float, 256> thresholds;
  std::array<double, 256> mid64;
  // The code of x (x / absmax, in [-1, 1]; NaN gives 0).
  uint8_t code(float x) const {
    uint32_t c = 0;
    for (uint32_t s = 128; s > 0; s >>= 1) c += thresholds[c + s - 1] <= x ? s : 0;
    return static_cast<uint8_t>(c);
  }
  uint8_t code(double x) const {
    uint32_t c = 0;
    for (uint32_t s = 128; s > 0; s >>= 1) c += mid64[c + s - 1] <= x ? s : 0;
    return static_cast<uint8_t>(c);
  }
  // The code of 0 (an all-zero state).
  uint8_t zero_code() const;
};

const Quant8Map& quant8_map(Quant8Kind kind);

// Blocks of a tensor of n elements.
inline constexpr int64_t quant8_blocks(int64_t n) { return (n + kQuant8Block - 1) / kQuant8Block; }

}  // namespace tessera
