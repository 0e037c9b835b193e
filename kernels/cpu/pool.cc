// CPU max_pool2d (NCHW) with argmax indices, and its backward: the gradient added at the
// indices.
//
// The common 2x2 stride-2 window without padding has its own loop (no bounds to clip),
// vectorised for f32 with AVX-512 compare masks and blends, so no branch depends on the
// data: a compare and branch per element (what GCC makes of the scalar fold) mispredicts
// about half the time on random data, which made the first version of this kernel take
// ~15 ns per output. Other windows and dtypes take the scalar fold.
#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

// Folds value v at flat index idx into the running (best, arg): a greater value wins, ties
// keep the first, and the first NaN wins for good (as in argmax).
template <typename C>
inline void fold_max(C v, int64_t idx, C& best, int64_t& arg) {
  bool take = v > best;
  if constexpr (std::is_floating_point_v<C>) take = take || (v != v && best == best);
  best = take ? v : best;
  arg = take ? idx : arg;
}

// One plane, 2x2 windows at stride 2 without padding: four loads and three folds.
template <typename T>
void max_pool_2x2(const T* plane, int64_t w, int64_t oh, int64_t ow, T* y, int64_t* idx) {
  using C = compute_t<T>;
  for (int64_t r = 0; r < oh; ++r) {
    const T* row0 = plane + 2 * r * w;
    const T* row1 = row0 + w;
    for (int64_t c = 0; c < ow; ++c) {
      const int64_t i0 = 2 * r * w + 2 * c;
      C best = C(row0[2 * c]);
      int64_t arg = i0;
      fold_max(C(row0[2 * c + 1]), i0 + 1, best, arg);
      fold_max(C(row1[2 * c]), i0 + w, best, arg);
      fold_max(C(row1[2 * c + 1]), i0 + w + 1, best, arg);
      y[r * ow + c] = T(best);
      idx[r * ow + c] = arg;
    }
  }
}

#if defined(__AVX512F__)
// max_pool_2x2 for f32 on 16 outputs at a time: the two input rows are loaded as 32 floats
// each, split into even and odd columns, and folded with compare masks and blends. Rows
// of fewer than 16 outputs (7 or 14 in an MNIST CNN) use masked loads and stores.
void max_pool_2x2_avx512(const float* plane, int64_t w, int64_t oh, int64_t ow, float* y,
                         int64_t* idx) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  // Offsets of the window's four positions from its top-left element.
  const __m512i pos[4] = {_mm512_setzero_si512(), _mm512_set1_epi32(1),
                          _mm512_set1_epi32(static_cast<int32_t>(w)),
                          _mm512_set1_epi32(static_cast<int32_t>(w + 1))};
  for (int64_t r = 0; r < oh; ++r) {
    const float* row0 = plane + 2 * r * w;
    const float* row1 = row0 + w;
    for (int64_t c0 = 0; c0 < ow; c0 += 16) {
      const int64_t n = std::min<int64_t>(16, ow - c0), n2 = 2 * n;
      const __mmask16 out_mask = static_cast<__mmask16>((1u << n) - 1);
      const __mmask16 lo = static_cast<__mmask16>(n2 >= 16 ? 0xFFFFu : (1u << n2) - 1);
      const __mmask16 hi = static_cast<__mmask16>(n2 <= 16 ? 0u : (1u << (n2 - 16)) - 1);
      const float* a = row0 + 2 * c0;
      const float* b = row1 + 2 * c0;
      const __m512 a_lo = _mm512_maskz_loadu_ps(lo, a), a_hi = _mm512_maskz_loadu_ps(hi, a + 16);
      const __m512 b_lo = _mm512_maskz_loadu_ps(lo, b), b_hi = _mm512_maskz_loadu_ps(hi, b + 16);
      const __m512 v[4] = {_mm512_permutex2var_ps(a_lo, even, a_hi),
                           _mm512_permutex2var_ps(a_lo, odd, a_hi),
                           _mm512_permutex2var_ps(b_lo, even, b_hi),
                           _mm512_permutex2var_ps(b_lo, odd, b_hi)};
      __m512 best = v[0];
      __m512i off = pos[0];
      for (int k = 1; k < 4; ++k) {
        // v > best, or v is the first NaN (fold_max's rule).
        const __mmask16 take = _mm512_cmp_ps_mask(v[k], best, _CMP_GT_OQ) |
                               (_mm512_cmp_ps_mask(v[k], v[k], _CMP_UNORD_Q) &
                                _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
        best = _mm512_mask_blend_ps(take, best, v[k]);
        off = _mm512_mask_blend_epi32(take, off, pos[k]);
      }
      _mm512_mask_storeu_ps(y + r * ow + c0, out_mask, best);
      // Flat index = 2r*w + 2*(c0 + lane) + off, widened to i64 in two halves.
      const __m512i local = _mm512_add_epi32(off, even);  // 2 * lane + off
      const __m512i base = _mm512_set1_epi64(2 * r * w + 2 * c0);
      const __m512i i_lo = _mm512_add_epi64(base, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(local)));
      const __m512i i_hi =
          _mm512_add_epi64(base, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(local, 1)));
      int64_t* dst = idx + r * ow + c0;
      _mm512_mask_storeu_epi64(dst, static_cast<__mmask8>(out_mask & 0xFF), i_lo);
      _mm512_mask_storeu_epi64(dst + 8, static_cast<__mmask8>(out_mask >> 8), i_hi);
    }
  }
}
#endif

// Any window, stride and padding; the window is clipped to the plane (padding never wins).
template <typename T>
void max_pool_any(const T* plane, int64_t h, int64_t w, int64_t oh, int64_t ow, const Attrs& a,
                  T* y, int64_t* idx) {
  using C = compute_t<T>;
  const int64_t kh = a.kernel_size[0], kw = a.kernel_size[1];
  const int64_t sh = a.stride[0], sw = a.stride[1], ph = a.padding[0], pw = a.padding[1];
  for (int64_t r = 0; r < oh; ++r) {
    const int64_t y0 = std::max<int64_t>(0, r * sh - ph), y1 = std::min(h, r * sh - ph + kh);
    for (int64_t c = 0; c < ow; ++c) {
      const int64_t x0 = std::max<int64_t>(0, c * sw - pw), x1 = std::min(w, c * sw - pw + kw);
      // padding <= kernel / 2 (checked by the meta), so every window holds an element.
      C best = C(plane[y0 * w + x0]);
      int64_t arg = y0 * w + x0;
      for (int64_t iy = y0; iy < y1; ++iy) {
        for (int64_t ix = iy == y0 ? x0 + 1 : x0; ix < x1; ++ix) {
          fold_max(C(plane[iy * w + ix]), iy * w + ix, best, arg);
        }
      }
      y[r * ow + c] = T(best);
      idx[r * ow + c] = arg;
    }
  }
}

// Outputs: values and the argmax as a flat index into the input plane (H * W).
void max_pool2d_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const int64_t planes = x.shape()[0] * x.shape()[1], h = x.shape()[2], w = x.shape()[3];
  const int64_t oh = out[0].shape()[2], ow = out[0].shape()[3];
  int64_t* ip = static_cast<int64_t*>(out[1].raw_data());
  const bool two_by_two = a.kernel_size == std::array<int64_t, 2>{2, 2} &&
                          a.stride == std::array<int64_t, 2>{2, 2} &&
                          a.padding == std::array<int64_t, 2>{0, 0};
  visit_dtype(x.dtype(), [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      const T* xp = static_cast<const T*>(x.raw_data());
      T* yp = static_cast<T*>(out[0].raw_data());
      const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, h * w));
      parallel_for(0, planes, grain, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) {
          const T* plane = xp + p * h * w;
          T* y = yp + p * oh * ow;
          int64_t* idx = ip + p * oh * ow;
          if (two_by_two) {
#if defined(__AVX512F__)
            // Window offsets are i32 lanes: up to w + 1 + 30.
            if constexpr (std::is_same_v<T, float>) {
              if (w < (int64_t{1} << 30)) {
                max_pool_2x2_avx512(plane, w, oh, ow, y, idx);
                continue;
              }
            }
#endif
            max_pool_2x2(plane, w, oh, ow, y, idx);
          } else {
            max_pool_any(plane, h, w, oh, ow, a, y, idx);
          }
        }
      });
    }
  });
}

// Inputs: grad [N, C, OH, OW], indices (i64 or i32, flat within each input plane);
// attrs.shape = input shape. Each plane of dx is zeroed, then gets grad added at its indices
// in output order, one thread per plane: overlapping windows sum in a fixed order. The plane
// stays in L1 between the two passes. 16-bit grads accumulate in f32 and round once.
void max_pool2d_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                const Attrs& a) {
  const Tensor g = contiguous_cpu(in[0]), ind = contiguous_cpu(in[1]);
  const int64_t planes = a.shape[0] * a.shape[1], hw = a.shape[2] * a.shape[3];
  const int64_t ohw = g.shape()[2] * g.shape()[3];
  visit_float_dtype(g.dtype(), "max_pool2d_backward", [&]<typename T>() {
    using C = compute_t<T>;
    const T* gp = static_cast<const T*>(g.raw_data());
    T* dp = static_cast<T*>(out[0].raw_data());
    auto run = [&]<typename I>(const I* ip) {
      const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, hw));
      parallel_for(0, planes, grain, [&](int64_t b, int64_t e) {
        std::vector<C> wide(std::is_same_v<T, C> ? 0 : hw);
        for (int64_t p = b; p < e; ++p) {
          C* acc = wide.data();
          if constexpr (std::is_same_v<T, C>) acc = dp + p * hw;
          std::fill(acc, acc + hw, C(0));
          const T* src = gp + p * ohw;
          const I* idx = ip + p * ohw;
          for (int64_t k = 0; k < ohw; ++k) {
            const int64_t i = idx[k];
            if (i < 0 || i >= hw) {
              fail("max_pool2d_backward: index {} is out of range for input planes of {} "
                   "elements (input shape {})",
                   i, hw, shape_str(a.shape));
            }
            acc[i] += C(src[k]);
          }
          if constexpr (!std::is_same_v<T, C>) {
            for (int64_t i = 0; i < hw; ++i) dp[p * hw + i] = T(acc[i]);
          }
        }
      });
    };
    if (ind.dtype() == DType::i64) run(static_cast<const int64_t*>(ind.raw_data()));
    else run(static_cast<const int32_t*>(ind.raw_data()));
  });
}

TS_REGISTER_KERNEL(cpu, max_pool2d, max_pool2d_kernel);
TS_REGISTER_KERNEL(cpu, max_pool2d_backward, max_pool2d_backward_kernel);

}  // namespace
}  // namespace tessera::cpu
