// Element types. f16 and bf16 are 16-bit storage types with round-to-nearest-even conversion
// from f32; kernels compute on them in f32 (compute_t<T>). u8 holds bytes such as the codes of
// 8-bit optimizer state (optim/quantize.h): it is created, copied, cast, sliced, moved between
// devices and ranks and saved, but arithmetic ops refuse it (cast to i32 or f32 first).
//
//   DType dt = DType::bf16;
//   visit_dtype(dt, [&]<typename T>() { ... T is BFloat16 here ... });
//   float x = static_cast<float>(BFloat16(1.5f));
#pragma once

#include <bit>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "tensor/error.h"

// With F16C (every AVX2 machine; -march=native and --config=portable both enable it) the
// f16 conversions below use the hardware's instructions outside constant evaluation: the
// same round-to-nearest-even, overflow to inf and subnormals, so the same bits in the default
// rounding mode (which Tessera never changes); NaNs keep the software path (f16 infinities
// too, when widening), whose NaN bits the CUDA kernels reproduce. nvcc's translation units
// see only the software path, which gives the same bits.
#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#define TS_F16C 1
#endif

namespace tessera {

enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, b8, u8 };
inline constexpr int kNumDTypes = 8;
inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                       DType::i32, DType::i64, DType::b8, DType::u8};

namespace detail {

// Round-to-nearest-even f32 -> IEEE binary16, with overflow to inf and subnormals kept.
// (The software path; float_to_half_bits below takes F16C's instruction where it can.)
constexpr uint16_t float_to_half_bits_soft(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536
  if (a < 0x38800000u) {
    // Subnormal half: adding 0.5 makes the float's ulp equal the half subnormal ulp (2^-24),
    // so the FPU's own round-to-nearest-even does the rounding.
    float af = std::bit_cast<float>(a) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(af) - 0x3f000000u));
  }
  const uint32_t odd = (a >> 13) & 1u;
  a += 0xc8000fffu + odd;  // rebias exponent 127 -> 15, round half to even
  return static_cast<uint16_t>(sign | (a >> 13));
}

constexpr uint16_t float_to_half_bits(float f) {
#ifdef TS_F16C
  if (!std::is_constant_evaluated() && (std::bit_cast<uint32_t>(f) & 0x7fffffffu) <= 0x7f800000u) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  return float_to_half_bits_soft(f);
}

// d rounded to f32 "to odd": truncated toward zero, with the last mantissa bit set when
// anything was dropped. Rounding that to f16/bf16 (at least 2 bits fewer) equals rounding d
// directly, whereas rounding d to nearest f32 first can land on a 16-bit tie and round the
// wrong way (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved
// algorithms using rounding to odd", 2008).
constexpr float double_to_float_round_odd(double d) {
  float f = static_cast<float>(d);
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7f800000u) == 0x7f800000u || static_cast<double>(f) == d) return f;
  uint32_t mag = bits;
  // Rounded away from zero: step the magnitude back by one ulp (same sign, so bits - 1).
  if ((f < 0 ? -static_cast<double>(f) : static_cast<double>(f)) > (d < 0 ? -d : d)) mag -= 1;
  return std::bit_cast<float>(mag | 1u);
}

constexpr float half_bits_to_float_soft(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float f = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24
    return std::bit_cast<float>(std::bit_cast<uint32_t>(f) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

constexpr float half_bits_to_float(uint16_t h) {
#ifdef TS_F16C
  if (!std::is_constant_evaluated() && (h & 0x7c00u) != 0x7c00u) return _cvtsh_ss(h);
#endif
  return half_bits_to_float_soft(h);
}

constexpr uint16_t float_to_bf16_bits(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

constexpr float bf16_bits_to_float(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

}  // namespace detail

struct Half {
  uint16_t bits = 0;
  Half() = default;
  constexpr explicit Half(float f) : bits(detail::float_to_half_bits(f)) {}
  // Rounds once, correctly (not twice through f32).
  constexpr explicit Half(double d) : Half(detail::double_to_float_round_odd(d)) {}
  template <typename I>
    requires std::is_integral_v<I>
  constexpr explicit Half(I v) : Half(static_cast<float>(v)) {}
  constexpr operator float() const { return detail::half_bits_to_float(bits); }
  static constexpr Half from_bits(uint16_t b) { Half h; h.bits = b; return h; }
};

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  constexpr explicit BFloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  // Rounds once, correctly (not twice through f32).
  constexpr explicit BFloat16(double d) : BFloat16(detail::double_to_float_round_odd(d)) {}
  template <typename I>
    requires std::is_integral_v<I>
  constexpr explicit BFloat16(I v) : BFloat16(static_cast<float>(v)) {}
  constexpr operator float() const { return detail::bf16_bits_to_float(bits); }
  static constexpr BFloat16 from_bits(uint16_t b) { BFloat16 h; h.bits = b; return h; }
};

template <typename T>
inline constexpr bool is_low_precision_v = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// The type kernels compute in: f32 for the 16-bit floats, the type itself otherwise.
template <typename T>
using compute_t = std::conditional_t<is_low_precision_v<T>, float, T>;

// Accumulator for sums: f32 sums accumulate blockwise in f32 and combine blocks in f64
// (see kernels/cpu/reduce.cc); integers accumulate in i64.
template <typename T>
using acc_t = std::conditional_t<std::is_floating_point_v<compute_t<T>>, compute_t<T>, int64_t>;

template <typename T>
struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<Half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::b8; };
template <> struct dtype_of<uint8_t> { static constexpr DType value = DType::u8; };
template <typename T>
inline constexpr DType dtype_of_v = dtype_of<T>::value;

constexpr int64_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::b8: return 1;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::b8: return "bool";
    case DType::u8: return "u8";
  }
  return "?";
}

constexpr bool is_floating(DType dt) {
  return dt == DType::f32 || dt == DType::f64 || dt == DType::f16 || dt == DType::bf16;
}
constexpr bool is_integral(DType dt) { return dt == DType::i32 || dt == DType::i64; }

// Parses "f32", "bf16", ... ; throws Error naming the accepted names otherwise.
DType dtype_from_name(std::string_view name);

// Calls f.template operator()<T>() with T the C++ type of dt.
template <typename F>
decltype(auto) visit_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::f64: return f.template operator()<double>();
    case DType::f16: return f.template operator()<Half>();
    case DType::bf16: return f.template operator()<BFloat16>();
    case DType::i32: return f.template operator()<int32_t>();
    case DType::i64: return f.template operator()<int64_t>();
    case DType::b8: return f.template operator()<bool>();
    case DType::u8: return f.template operator()<uint8_t>();
  }
  fail("visit_dtype: invalid dtype {}", static_cast<int>(dt));
}

// Like visit_dtype for the four floating types; other dtypes throw naming `op`.
template <typename F>
decltype(auto) visit_float_dtype(DType dt, std::string_view op, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::f64: return f.template operator()<double>();
    case DType::f16: return f.template operator()<Half>();
    case DType::bf16: return f.template operator()<BFloat16>();
    default: fail("{}: expected a floating dtype (f32, f64, f16, bf16), got {}", op, dtype_name(dt));
  }
}

}  // namespace tessera

template <>
struct fmt::formatter<tessera::DType> : fmt::formatter<std::string_view> {
  auto format(tessera::DType dt, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(tessera::dtype_name(dt), ctx);
  }
};
