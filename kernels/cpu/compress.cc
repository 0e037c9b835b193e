// 1-bit compression's bit packing (tensor/ops.h: sign_pack, sign_unpack): 8 signs a byte,
// bit j of byte k for element 8k + j, set when the element is not negative (>= 0 or NaN).
// Threads take runs of bytes; with AVX-512, f32 packs 16 lanes at a time (one compare to a
// mask, written as two bytes) and unpacks them with one masked blend (f64: 8).
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/parallel.h"
#include "tensor/op.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera::cpu {
namespace {

constexpr int64_t kBytesGrain = int64_t{1} << 14;

template <typename T>
uint8_t pack8(const T* x, int64_t count) {
  uint8_t b = 0;
  for (int64_t j = 0; j < count; ++j) b |= static_cast<uint8_t>(!(float(x[j]) < 0.0f) ? 1u << j : 0u);
  return b;
}

template <>
uint8_t pack8<double>(const double* x, int64_t count) {
  uint8_t b = 0;
  for (int64_t j = 0; j < count; ++j) b |= static_cast<uint8_t>(!(x[j] < 0.0) ? 1u << j : 0u);
  return b;
}

template <typename T>
void pack_run(const T* x, uint8_t* out, int64_t n, int64_t b0, int64_t b1) {
  int64_t b = b0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 zero = _mm512_setzero_ps();
    for (; b + 2 <= b1 && 8 * (b + 2) <= n; b += 2) {
      // Not less than 0, unordered: NaN counts as not negative.
      const __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + 8 * b), zero, _CMP_NLT_UQ);
      const uint16_t bits = static_cast<uint16_t>(m);
      std::memcpy(out + b, &bits, 2);
    }
  }
#endif
  for (; b < b1; ++b) out[b] = pack8<T>(x + 8 * b, std::min<int64_t>(8, n - 8 * b));
}

void sign_pack_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor x = in[0].is_contiguous() ? in[0] : in[0].contiguous();
  const int64_t n = x.numel(), bytes = out[0].numel();
  auto* dst = static_cast<uint8_t*>(out[0].raw_data());
  visit_float_dtype(x.dtype(), "sign_pack", [&]<typename T>() {
    const T* src = static_cast<const T*>(x.raw_data());
    parallel_for(0, bytes, kBytesGrain, [&](int64_t b0, int64_t b1) { pack_run<T>(src, dst, n, b0, b1); });
  });
}

// Elements [8 b0, min(8 b1, n)) from bytes [b0, b1): f32 16 lanes at a time with AVX-512
// (two bytes as a mask blending +1 and -1), f64 8; other dtypes and the tail element by
// element.
template <typename T>
void unpack_run(const uint8_t* src, T* dst, int64_t n, int64_t b0, int64_t b1) {
  const T plus = T(1.0f), minus = T(-1.0f);
  int64_t b = b0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 p = _mm512_set1_ps(1.0f), m = _mm512_set1_ps(-1.0f);
    for (; b + 2 <= b1 && 8 * (b + 2) <= n; b += 2) {
      uint16_t bits;
      std::memcpy(&bits, src + b, 2);
      _mm512_storeu_ps(dst + 8 * b, _mm512_mask_blend_ps(static_cast<__mmask16>(bits), m, p));
    }
  } else if constexpr (std::is_same_v<T, double>) {
    const __m512d p = _mm512_set1_pd(1.0), m = _mm512_set1_pd(-1.0);
    for (; b < b1 && 8 * (b + 1) <= n; ++b) {
      _mm512_storeu_pd(dst + 8 * b, _mm512_mask_blend_pd(static_cast<__mmask8>(src[b]), m, p));
    }
  }
#endif
  for (int64_t i = 8 * b, end = std::min(8 * b1, n); i < end; ++i) {
    dst[i] = (src[i >> 3] >> (i & 7)) & 1 ? plus : minus;
  }
}

void sign_unpack_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor bits = in[0].is_contiguous() ? in[0] : in[0].contiguous();
  const auto* src = static_cast<const uint8_t*>(bits.raw_data());
  const int64_t n = out[0].numel(), bytes = (n + 7) / 8;
  visit_float_dtype(out[0].dtype(), "sign_unpack", [&]<typename T>() {
    T* dst = static_cast<T*>(out[0].raw_data());
    parallel_for(0, bytes, kBytesGrain, [&](int64_t b0, int64_t b1) { unpack_run<T>(src, dst, n, b0, b1); });
  });
}

}  // namespace

TS_REGISTER_KERNEL(cpu, sign_pack, sign_pack_kernel);
TS_REGISTER_KERNEL(cpu, sign_unpack, sign_unpack_kernel);

}  // namespace tessera::cpu
