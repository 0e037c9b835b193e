// CPU optimizer updates, fused: adamw_, adamw8bit_ and sgd_ read the gradient and write param, moments
// and the optional f32 master copy in one pass (PyTorch's single-tensor semantics, see
// tensor/ops.h). f16/bf16 params are updated in f32 (on the master when there is one) and
// written back rounded once; the moments are f32 (f64 for f64 params). Both also take the
// multi-tensor form (k tuples of inputs, see tensor/meta_optim.cc): each tuple is updated
// exactly as a single-tensor call would update it.
//
// Built with -fno-math-errno (kernels/cpu/BUILD): otherwise GCC keeps sqrt as a call that
// may set errno and does not vectorise the AdamW loop.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/reduce_blocks.h"
#include "kernels/cpu/util.h"
#include "kernels/cpu/update_checks.h"
#include "tensor/op.h"
#include "tensor/quant8.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tessera::cpu {
namespace {

// An update costs ~4x a plain elementwise op per element, so chunks can be smaller.
constexpr int64_t kUpdateGrain = kElementwiseGrain / 4;

template <typename T>
T* at(char* base) {
  return reinterpret_cast<T*>(base);
}

// Element strides of a run; all 1 on the contiguous fast path (a compile-time constant
// there, so the loop vectorises).
template <int N>
bool contiguous_run(const Run<N>& r, const std::array<int64_t, N>& sizes) {
  for (int k = 0; k < N; ++k) {
    if (r.stride[k] != sizes[k]) return false;
  }
  return true;
}

// ---- AdamW ---------------------------------------------------------------------------------

template <typename C>
struct AdamConsts {
  C decay;      // 1 - lr * weight_decay
  C w1;         // 1 - beta1 (exp_avg lerps towards grad by this weight)
  C beta2, w2;  // exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2
  C bc2_sqrt;   // sqrt(1 - beta2^t)
  C eps;
  C step_size;  // lr / (1 - beta1^t)
  C grad_scale; // the gradient is read as grad * grad_scale (when != 1)
};

// grad * grad_scale as scale_ computes it: in the compute type S, rounded once to the
// gradient's dtype P, so that the update equals scale_ (clipping) and then the update.
template <typename P, typename S>
S scaled_grad(S g, S grad_scale) {
  return S(P(g * grad_scale));
}

template <typename S>
AdamConsts<S> adam_consts(const Attrs& a) {
  const double t = static_cast<double>(a.step_count);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
  return {S(1.0 - a.lr * a.weight_decay), S(1.0 - a.beta1), S(a.beta2),
          S(1.0 - a.beta2), S(std::sqrt(bc2)), S(a.eps), S(a.lr / bc1), S(a.grad_scale)};
}

// P: param/grad type; S: moment (and compute) type; master: f32 when kMaster.
template <bool kContig, bool kMaster, bool kScaled, typename P, typename S, int N>
void adamw_run(const Run<N>& r, const AdamConsts<S>& k) {
  constexpr int64_t sp = sizeof(P), ss = sizeof(S);
  const int64_t n = r.n;
  P* __restrict p = at<P>(r.ptr[0]);
  const P* __restrict g = at<const P>(r.ptr[1]);
  S* __restrict m = at<S>(r.ptr[2]);
  S* __restrict v = at<S>(r.ptr[3]);
  float* __restrict w = nullptr;
  const int64_t s0 = kContig ? 1 : r.stride[0] / sp, s1 = kContig ? 1 : r.stride[1] / sp;
  const int64_t s2 = kContig ? 1 : r.stride[2] / ss, s3 = kContig ? 1 : r.stride[3] / ss;
  int64_t s4 = 1;
  if constexpr (kMaster) {
    w = at<float>(r.ptr[4]);
    s4 = kContig ? 1 : r.stride[4] / int64_t(sizeof(float));
  }
  for (int64_t i = 0; i < n; ++i) {
    S x;
    if constexpr (kMaster) x = w[i * s4];
    else x = S(p[i * s0]);
    S gi = S(g[i * s1]);
    if constexpr (kScaled) gi = scaled_grad<P>(gi, k.grad_scale);
    x *= k.decay;
    S mi = m[i * s2];
    mi += k.w1 * (gi - mi);
    m[i * s2] = mi;
    const S vi = v[i * s3] * k.beta2 + k.w2 * (gi * gi);
    v[i * s3] = vi;
    const S denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
    x -= k.step_size * (mi / denom);
    if constexpr (kMaster) w[i * s4] = x;
    p[i * s0] = P(x);
  }
}

template <typename P, bool kMaster>
void adamw_typed(std::span<const Tensor> in, const Attrs& a) {
  using S = std::conditional_t<std::is_same_v<P, double>, double, float>;
  const AdamConsts<S> k = adam_consts<S>(a);
  const bool scaled = a.grad_scale != 1.0;
  constexpr int N = kMaster ? 5 : 4;
  std::array<int64_t, N> sizes;
  sizes.fill(int64_t(sizeof(S)));
  sizes[0] = sizes[1] = int64_t(sizeof(P));
  Operands<N> ops;
  if constexpr (kMaster) {
    sizes[4] = int64_t(sizeof(float));
    ops = operands_for<N>(in[0], {in[1], in[2], in[3], in[4]});
  } else {
    ops = operands_for<N>(in[0], {in[1], in[2], in[3]});
  }
  for_each_run(
      ops,
      [&](const Run<N>& r) {
        const bool contig = contiguous_run<N>(r, sizes);
        if (contig && scaled) adamw_run<true, kMaster, true, P, S>(r, k);
        else if (contig) adamw_run<true, kMaster, false, P, S>(r, k);
        else if (scaled) adamw_run<false, kMaster, true, P, S>(r, k);
        else adamw_run<false, kMaster, false, P, S>(r, k);
      },
      kUpdateGrain);
}

void adamw_one(std::span<const Tensor> in, const Attrs& a) {
  const bool master = in.size() > 4 && in[4].defined();
  visit_float_dtype(in[0].dtype(), "adamw_", [&]<typename P>() {
    if constexpr (std::is_same_v<P, double>) {
      adamw_typed<P, false>(in, a);  // the meta function rejects an f64 param's master
    } else {
      if (master) adamw_typed<P, true>(in, a);
      else adamw_typed<P, false>(in, a);
    }
  });
}

void adamw_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 5);
  const size_t count = in.size() < 10 ? 0 : tuples.size();  // 0: the single-tensor form
  // Every tuple is checked before any is written: an error leaves all of them untouched.
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("adamw_", j, count, tuples[j],
                     {"param", "grad", "exp_avg", "exp_avg_sq", "master"});
  }
  for (std::span<const Tensor> t : tuples) adamw_one(t, a);
}

// ---- AdamW with 8-bit state ---------------------------------------------------------------
// Block by block (tensor/quant8.h): dequantize both moments, the AdamW step of adamw_run in
// the state type, the blocks' new absmax, requantize. Blocks are independent, so threads
// take runs of whole blocks.
//
// adamw8bit_segments_ runs the same arithmetic in two passes over segments (parts of blocks
// whose other elements are elsewhere): kUpdate writes param and each segment's maxima,
// kRequantize recomputes the moments (the same operations, so the same values) and codes
// them on the blocks' maxima over every holder. kFused is adamw8bit_'s single pass.
enum class Adam8Pass { kFused, kUpdate, kRequantize };

template <typename P, typename S, bool kMaster>
struct Adam8Operands {
  P* p;
  const P* g;
  uint8_t* c1;
  uint8_t* c2;
  S* a1;
  S* a2;
  float* w;
};

#if defined(__AVX512F__)
// Quant8Map::code's search, 16 lanes at a time. The search adds s = 128, 64, ..., 1 to the
// code c when thresholds[c + s - 1] <= x; before step s, c is a multiple of 2s, so step s
// reads one of 256 / (2s) thresholds, all held in registers (no gathers): s >= 8 reads one
// register (at most 16 candidates), s = 4 a pair (32), s = 2 two pairs (64), s = 1 four (128),
// the pairs by permutex2var, then a blend on the index's high bits.
struct Quant8Search {
  __m512 t64, t32, t16, t8, t4a, t4b;
  __m512 t2[4], t1[8];
  __m512 values[16];  // the map, for dequantizing without gathers
  float t127;
  explicit Quant8Search(const Quant8Map& q) {
    alignas(64) float tab[6][16] = {};
    auto fill = [&](float* dst, int s, int first, int count) {
      for (int k = 0; k < count; ++k) dst[k] = q.thresholds[(first + k) * 2 * s + s - 1];
    };
    fill(tab[0], 64, 0, 2);
    fill(tab[1], 32, 0, 4);
    fill(tab[2], 16, 0, 8);
    fill(tab[3], 8, 0, 16);
    fill(tab[4], 4, 0, 16);
    fill(tab[5], 4, 16, 16);
    t64 = _mm512_load_ps(tab[0]);
    t32 = _mm512_load_ps(tab[1]);
    t16 = _mm512_load_ps(tab[2]);
    t8 = _mm512_load_ps(tab[3]);
    t4a = _mm512_load_ps(tab[4]);
    t4b = _mm512_load_ps(tab[5]);
    t127 = q.thresholds[127];
    alignas(64) float wide[8][16];
    for (int r = 0; r < 4; ++r) fill(wide[r], 2, 16 * r, 16);
    for (int r = 0; r < 4; ++r) t2[r] = _mm512_load_ps(wide[r]);
    for (int r = 0; r < 8; ++r) fill(wide[r], 1, 16 * r, 16);
    for (int r = 0; r < 8; ++r) t1[r] = _mm512_load_ps(wide[r]);
    for (int r = 0; r < 16; ++r) values[r] = _mm512_loadu_ps(q.values.data() + 16 * r);
  }
  // values[code] for 16 codes (0..255).
  __m512 value(__m512i code) const {
    const __m512 lo = lookup(values, 4, code), hi = lookup(values + 8, 4, code);
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(code, _mm512_set1_epi32(128)), lo, hi);
  }
  // Entry k (k < 32 x pairs) of the registers regs[0..2 pairs): pair k / 32, lane k % 32.
  static __m512 lookup(const __m512* regs, int pairs, __m512i k) {
    __m512 v[4];
    for (int p = 0; p < pairs; ++p) v[p] = _mm512_permutex2var_ps(regs[2 * p], k, regs[2 * p + 1]);
    if (pairs == 1) return v[0];
    const __mmask16 b5 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(32));
    if (pairs == 2) return _mm512_mask_blend_ps(b5, v[0], v[1]);
    const __mmask16 b6 = _mm512_test_epi32_mask(k, _mm512_set1_epi32(64));
    return _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, v[0], v[1]),
                                _mm512_mask_blend_ps(b5, v[2], v[3]));
  }
  __m512i code(__m512 x) const {
    auto step = [&](__m512i c, __m512 t, int s) {
      return _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(t, x, _CMP_LE_OQ), c,
                                   _mm512_set1_epi32(s));
    };
    __m512i c = step(_mm512_setzero_si512(), _mm512_set1_ps(t127), 128);
    c = step(c, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 7), t64), 64);
    c = step(c, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 6), t32), 32);
    c = step(c, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 5), t16), 16);
    c = step(c, _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), t8), 8);
    c = step(c, _mm512_permutex2var_ps(t4a, _mm512_srli_epi32(c, 3), t4b), 4);
    c = step(c, lookup(t2, 2, _mm512_srli_epi32(c, 2)), 2);
    return step(c, lookup(t1, 4, _mm512_srli_epi32(c, 1)), 1);
  }
};

// The f32-state block with AVX-512: 16 lanes, the maps read from registers (Quant8Search),
// the codes found by the same 8-step search over the thresholds as Quant8Map::code, each
// lane's arithmetic the
// scalar loop's operation for operation (mul, add, sub, div, sqrt round once each; this
// target is built with -ffp-contract=off), so the results are bitwise the scalar ones.
template <Adam8Pass kPass, typename P, bool kMaster>
void adamw8bit_span_avx512(const Adam8Operands<P, float, kMaster>& o, int64_t i0, int64_t count,
                           float s1_in, float s2_in, const AdamConsts<float>& k, float& a1,
                           float& a2) {
  static const Quant8Search search1(quant8_map(Quant8Kind::signed_dynamic));
  static const Quant8Search search2(quant8_map(Quant8Kind::unsigned_dynamic));
  constexpr bool kParam = kPass != Adam8Pass::kRequantize;
  constexpr bool kCodes = kPass != Adam8Pass::kUpdate;
  const int len = static_cast<int>(count);
  P* __restrict p = o.p + i0;
  const P* __restrict g = o.g + i0;
  uint8_t* __restrict c1 = o.c1 + i0;
  uint8_t* __restrict c2 = o.c2 + i0;
  float* __restrict w = kMaster ? o.w + i0 : nullptr;
  alignas(64) float x[kQuant8Block], gf[kQuant8Block], m[kQuant8Block], v[kQuant8Block];
  if constexpr (!kParam) {
  } else if constexpr (std::is_same_v<P, float> && !kMaster) {
    std::memcpy(x, p, sizeof(float) * static_cast<size_t>(len));
  } else {
    for (int i = 0; i < len; ++i) x[i] = kMaster ? w[i] : float(p[i]);
  }
  if (k.grad_scale != 1.0f) {
    for (int i = 0; i < len; ++i) gf[i] = scaled_grad<P>(float(g[i]), k.grad_scale);
  } else if constexpr (std::is_same_v<P, float>) {
    std::memcpy(gf, g, sizeof(float) * static_cast<size_t>(len));
  } else {
    for (int i = 0; i < len; ++i) gf[i] = float(g[i]);
  }
  const __m512 s1 = _mm512_set1_ps(s1_in), s2 = _mm512_set1_ps(s2_in);
  const __m512 decay = _mm512_set1_ps(k.decay), w1 = _mm512_set1_ps(k.w1),
               beta2 = _mm512_set1_ps(k.beta2), w2 = _mm512_set1_ps(k.w2),
               bc2 = _mm512_set1_ps(k.bc2_sqrt), eps = _mm512_set1_ps(k.eps),
               step = _mm512_set1_ps(k.step_size);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 max1 = _mm512_setzero_ps(), max2 = _mm512_setzero_ps();
  for (int i = 0; i < len; i += 16) {
    const __mmask16 lanes = len - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - i)) - 1);
    const __m512i k1 = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, c1 + i));
    const __m512i k2 = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes, c2 + i));
    const __m512 gi = _mm512_maskz_loadu_ps(lanes, gf + i);
    __m512 mi = _mm512_mul_ps(search1.value(k1), s1);
    mi = _mm512_add_ps(mi, _mm512_mul_ps(w1, _mm512_sub_ps(gi, mi)));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(search2.value(k2), s2), beta2),
                      _mm512_mul_ps(w2, _mm512_mul_ps(gi, gi)));
    if constexpr (kParam) {
      __m512 xi = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, x + i), decay);
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
      xi = _mm512_sub_ps(xi, _mm512_mul_ps(step, _mm512_div_ps(mi, denom)));
      _mm512_store_ps(x + i, xi);
    }
    if constexpr (kCodes) {
      _mm512_store_ps(m + i, mi);
      _mm512_store_ps(v + i, vi);
    }
    // Lanes past the block's end leave the maxima alone. vmaxps returns its second operand
    // when either is NaN: with the running max second, a NaN moment is skipped, as the
    // scalar loop's max1 < am ? am : max1 skips it.
    max1 = _mm512_mask_max_ps(max1, lanes, _mm512_andnot_ps(sign, mi), max1);
    max2 = _mm512_mask_max_ps(max2, lanes, vi, max2);
  }
  if constexpr (!kParam) {
  } else if constexpr (std::is_same_v<P, float> && !kMaster) {
    std::memcpy(p, x, sizeof(float) * static_cast<size_t>(len));
  } else {
    for (int i = 0; i < len; ++i) {
      if constexpr (kMaster) w[i] = x[i];
      p[i] = P(x[i]);
    }
  }
  if constexpr (kPass != Adam8Pass::kRequantize) {
    a1 = _mm512_reduce_max_ps(max1);
    a2 = _mm512_reduce_max_ps(max2);
  }
  if constexpr (!kCodes) return;
  const __m512 d1 = _mm512_set1_ps(a1 > 0 ? a1 : 1.0f), d2 = _mm512_set1_ps(a2 > 0 ? a2 : 1.0f);
  auto quantize = [&](const float* src, uint8_t* dst, const Quant8Search& q, __m512 d) {
    for (int i = 0; i < len; i += 16) {
      const __mmask16 lanes =
          len - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - i)) - 1);
      const __m512i c = q.code(_mm512_div_ps(_mm512_load_ps(src + i), d));
      _mm512_mask_cvtepi32_storeu_epi8(dst + i, lanes, c);
    }
  };
  quantize(m, c1, search1, d1);
  quantize(v, c2, search2, d2);
}
#endif

// The `len` (<= kQuant8Block) elements from i0 of one block whose scales were s1 and s2.
// kFused and kUpdate set a1 / a2 to the new maxima of |m| and v over these elements;
// kRequantize reads them as the block's new scales (the maxima over all its elements).
template <Adam8Pass kPass, typename P, typename S, bool kMaster>
void adamw8bit_span(const Adam8Operands<P, S, kMaster>& o, int64_t i0, int64_t len, S s1, S s2,
                    const AdamConsts<S>& k, const Quant8Map& q1, const Quant8Map& q2, S& a1,
                    S& a2) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<S, float>) {
    return adamw8bit_span_avx512<kPass, P, kMaster>(o, i0, len, s1, s2, k, a1, a2);
  }
#endif
  constexpr bool kParam = kPass != Adam8Pass::kRequantize;
  P* __restrict p = o.p + i0;
  const P* __restrict g = o.g + i0;
  uint8_t* __restrict c1 = o.c1 + i0;
  uint8_t* __restrict c2 = o.c2 + i0;
  float* __restrict w = kMaster ? o.w + i0 : nullptr;
  alignas(64) S m[kQuant8Block], v[kQuant8Block];
  S max1 = 0, max2 = 0;
  const bool scaled = k.grad_scale != S(1);
  for (int64_t i = 0; i < len; ++i) {
    const S gi = scaled ? scaled_grad<P>(S(g[i]), k.grad_scale) : S(g[i]);
    S mi = S(q1.values[c1[i]]) * s1;
    mi += k.w1 * (gi - mi);
    const S vi = (S(q2.values[c2[i]]) * s2) * k.beta2 + k.w2 * (gi * gi);
    if constexpr (kParam) {
      S x;
      if constexpr (kMaster) x = w[i];
      else x = S(p[i]);
      x *= k.decay;
      const S denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
      x -= k.step_size * (mi / denom);
      if constexpr (kMaster) w[i] = x;
      p[i] = P(x);
    }
    m[i] = mi;
    v[i] = vi;
    const S am = std::fabs(mi);
    max1 = max1 < am ? am : max1;
    max2 = max2 < vi ? vi : max2;
  }
  if constexpr (kPass != Adam8Pass::kRequantize) {
    a1 = max1;
    a2 = max2;
  } else {
    max1 = a1;
    max2 = a2;
  }
  if constexpr (kPass == Adam8Pass::kUpdate) return;
  // x / 0 counts as 0: an all-zero block keeps the zero codes.
  const S d1 = max1 > 0 ? max1 : S(1), d2 = max2 > 0 ? max2 : S(1);
  for (int64_t i = 0; i < len; ++i) c1[i] = q1.code(m[i] / d1);
  for (int64_t i = 0; i < len; ++i) c2[i] = q2.code(v[i] / d2);
}


template <typename P, bool kMaster>
void adamw8bit_typed(std::span<const Tensor> in, const Attrs& a) {
  using S = std::conditional_t<std::is_same_v<P, double>, double, float>;
  const AdamConsts<S> k = adam_consts<S>(a);
  const Adam8Operands<P, S, kMaster> o{
      static_cast<P*>(in[0].raw_data()),       static_cast<const P*>(in[1].raw_data()),
      static_cast<uint8_t*>(in[2].raw_data()), static_cast<uint8_t*>(in[3].raw_data()),
      static_cast<S*>(in[4].raw_data()),       static_cast<S*>(in[5].raw_data()),
      kMaster ? static_cast<float*>(in[6].raw_data()) : nullptr};
  const Quant8Map& q1 = quant8_map(Quant8Kind::signed_dynamic);
  const Quant8Map& q2 = quant8_map(Quant8Kind::unsigned_dynamic);
  const int64_t n = in[0].numel();
  parallel_for(0, quant8_blocks(n), std::max<int64_t>(1, kUpdateGrain / kQuant8Block),
               [&](int64_t b0, int64_t b1) {
                 for (int64_t b = b0; b < b1; ++b) {
                   const int64_t i0 = b * kQuant8Block;
                   adamw8bit_span<Adam8Pass::kFused>(o, i0, std::min(kQuant8Block, n - i0),
                                                     o.a1[b], o.a2[b], k, q1, q2, o.a1[b],
                                                     o.a2[b]);
                 }
               });
}

void adamw8bit_one(std::span<const Tensor> in, const Attrs& a) {
  const bool master = in.size() > 6 && in[6].defined();
  visit_float_dtype(in[0].dtype(), "adamw8bit_", [&]<typename P>() {
    if constexpr (std::is_same_v<P, double>) {
      adamw8bit_typed<P, false>(in, a);  // the meta function rejects an f64 param's master
    } else {
      if (master) adamw8bit_typed<P, true>(in, a);
      else adamw8bit_typed<P, false>(in, a);
    }
  });
}

void adamw8bit_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 7);
  const size_t count = in.size() < 14 ? 0 : tuples.size();  // 0: the single-tensor form
  check_adamw8bit_operands(tuples, count);
  for (std::span<const Tensor> t : tuples) {
    if (t[1].is_contiguous()) {
      adamw8bit_one(t, a);
    } else {  // grad is only read: a contiguous copy will do
      std::vector<Tensor> copy(t.begin(), t.end());
      copy[1] = t[1].contiguous();
      adamw8bit_one(copy, a);
    }
  }
}

// adamw8bit_segments_ (tensor/ops.h): inputs param, grad, exp_avg, exp_avg_sq,
// exp_avg_absmax, exp_avg_sq_absmax, master (maybe undefined), segments, new_absmax,
// new_sq_absmax; attrs.k the pass (1 update, 2 requantize). Threads take runs of segments.
template <typename P, bool kMaster>
void adamw8bit_segments_typed(std::span<const Tensor> in, const Attrs& a,
                              std::span<const int64_t> seg) {
  using S = std::conditional_t<std::is_same_v<P, double>, double, float>;
  const AdamConsts<S> k = adam_consts<S>(a);
  const Adam8Operands<P, S, kMaster> o{
      static_cast<P*>(in[0].raw_data()),       static_cast<const P*>(in[1].raw_data()),
      static_cast<uint8_t*>(in[2].raw_data()), static_cast<uint8_t*>(in[3].raw_data()),
      static_cast<S*>(in[4].raw_data()),       static_cast<S*>(in[5].raw_data()),
      kMaster ? static_cast<float*>(in[6].raw_data()) : nullptr};
  S* new1 = static_cast<S*>(in[8].raw_data());
  S* new2 = static_cast<S*>(in[9].raw_data());
  const int64_t blocks = in[4].numel(), segments = static_cast<int64_t>(seg.size()) / 2;
  const Quant8Map& q1 = quant8_map(Quant8Kind::signed_dynamic);
  const Quant8Map& q2 = quant8_map(Quant8Kind::unsigned_dynamic);
  const bool update = a.k == 1;
  if (update) std::fill(new1, new1 + blocks, S(0)), std::fill(new2, new2 + blocks, S(0));
  parallel_for(0, segments, std::max<int64_t>(1, kUpdateGrain / kQuant8Block),
               [&](int64_t s0, int64_t s1) {
                 for (int64_t s = s0; s < s1; ++s) {
                   const int64_t i0 = s == 0 ? 0 : seg[2 * (s - 1)];
                   const int64_t len = seg[2 * s] - i0, b = seg[2 * s + 1];
                   if (update) {
                     adamw8bit_span<Adam8Pass::kUpdate>(o, i0, len, o.a1[b], o.a2[b], k, q1, q2,
                                                        new1[b], new2[b]);
                   } else {
                     adamw8bit_span<Adam8Pass::kRequantize>(o, i0, len, o.a1[b], o.a2[b], k, q1,
                                                            q2, new1[b], new2[b]);
                   }
                 }
               });
  if (!update) {  // every block's scale becomes the new one (the same on every holder)
    std::copy(new1, new1 + blocks, o.a1);
    std::copy(new2, new2 + blocks, o.a2);
  }
}

void adamw8bit_segments_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  check_adamw8bit_segments_operands(in);
  const Tensor grad = in[1].is_contiguous() ? in[1] : in[1].contiguous();
  std::vector<Tensor> t(in.begin(), in.end());
  t[1] = grad;
  const std::span<const int64_t> seg(static_cast<const int64_t*>(in[7].raw_data()),
                                     static_cast<size_t>(in[7].numel()));
  const bool master = in[6].defined();
  visit_float_dtype(in[0].dtype(), "adamw8bit_segments_", [&]<typename P>() {
    if constexpr (std::is_same_v<P, double>) {
      adamw8bit_segments_typed<P, false>(t, a, seg);
    } else {
      if (master) adamw8bit_segments_typed<P, true>(t, a, seg);
      else adamw8bit_segments_typed<P, false>(t, a, seg);
    }
  });
}

// ---- SGD -----------------------------------------------------------------------------------

template <typename C>
struct SgdConsts {
  C lr, weight_decay, momentum, one_minus_dampening;
  bool decay, nesterov, first;
  C grad_scale;
  bool scaled;  // grad_scale != 1
};

template <bool kContig, bool kBuffer, bool kMaster, typename P, typename S, int N>
void sgd_run(const Run<N>& r, const SgdConsts<S>& k) {
  constexpr int64_t sp = sizeof(P), ss = sizeof(S);
  constexpr int kMasterOperand = kBuffer ? 3 : 2;
  const int64_t n = r.n;
  P* __restrict p = at<P>(r.ptr[0]);
  const P* __restrict g = at<const P>(r.ptr[1]);
  S* __restrict b = nullptr;
  float* __restrict w = nullptr;
  const int64_t s0 = kContig ? 1 : r.stride[0] / sp, s1 = kContig ? 1 : r.stride[1] / sp;
  int64_t sb = 1, sw = 1;
  if constexpr (kBuffer) {
    b = at<S>(r.ptr[2]);
    sb = kContig ? 1 : r.stride[2] / ss;
  }
  if constexpr (kMaster) {
    w = at<float>(r.ptr[kMasterOperand]);
    sw = kContig ? 1 : r.stride[kMasterOperand] / int64_t(sizeof(float));
  }
  // The flags are the same for every element; GCC unswitches the loop on them.
  for (int64_t i = 0; i < n; ++i) {
    S x;
    if constexpr (kMaster) x = w[i * sw];
    else x = S(p[i * s0]);
    S d = S(g[i * s1]);
    if (k.scaled) d = scaled_grad<P>(d, k.grad_scale);
    // Skipped, not multiplied by 0, when weight_decay == 0: 0 * inf would be NaN.
    if (k.decay) d += k.weight_decay * x;
    if constexpr (kBuffer) {
      const S bi = k.first ? d : b[i * sb] * k.momentum + k.one_minus_dampening * d;
      b[i * sb] = bi;
      d = k.nesterov ? d + k.momentum * bi : bi;
    }
    x -= k.lr * d;
    if constexpr (kMaster) w[i * sw] = x;
    p[i * s0] = P(x);
  }
}

template <typename P, bool kBuffer, bool kMaster>
void sgd_typed(std::span<const Tensor> in, const Attrs& a) {
  using S = std::conditional_t<std::is_same_v<P, double>, double, float>;
  const SgdConsts<S> k{S(a.lr),       S(a.weight_decay),  S(a.momentum), S(1.0 - a.dampening),
                       a.weight_decay != 0.0, a.nesterov, a.step_count == 1,
                       S(a.grad_scale), a.grad_scale != 1.0};
  constexpr int N = 2 + (kBuffer ? 1 : 0) + (kMaster ? 1 : 0);
  std::array<int64_t, N> sizes;
  sizes.fill(int64_t(sizeof(P)));
  Operands<N> ops;
  if constexpr (kBuffer && kMaster) {
    sizes[2] = int64_t(sizeof(S));
    sizes[3] = int64_t(sizeof(float));
    ops = operands_for<N>(in[0], {in[1], in[2], in[3]});
  } else if constexpr (kBuffer) {
    sizes[2] = int64_t(sizeof(S));
    ops = operands_for<N>(in[0], {in[1], in[2]});
  } else if constexpr (kMaster) {
    sizes[2] = int64_t(sizeof(float));
    ops = operands_for<N>(in[0], {in[1], in[3]});
  } else {
    ops = operands_for<N>(in[0], {in[1]});
  }
  for_each_run(
      ops,
      [&](const Run<N>& r) {
        if (contiguous_run<N>(r, sizes)) sgd_run<true, kBuffer, kMaster, P, S>(r, k);
        else sgd_run<false, kBuffer, kMaster, P, S>(r, k);
      },
      kUpdateGrain);
}

void sgd_one(std::span<const Tensor> in, const Attrs& a) {
  const bool buffer = in[2].defined();
  const bool master = in.size() > 3 && in[3].defined();
  visit_float_dtype(in[0].dtype(), "sgd_", [&]<typename P>() {
    auto with_master = [&]<bool kMaster>() {
      if (buffer) sgd_typed<P, true, kMaster>(in, a);
      else sgd_typed<P, false, kMaster>(in, a);
    };
    if constexpr (std::is_same_v<P, double>) {
      with_master.template operator()<false>();
    } else {
      if (master) with_master.template operator()<true>();
      else with_master.template operator()<false>();
    }
  });
}

void sgd_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 4);
  const size_t count = in.size() < 8 ? 0 : tuples.size();  // 0: the single-tensor form
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("sgd_", j, count, tuples[j], {"param", "grad", "momentum_buffer", "master"});
  }
  for (std::span<const Tensor> t : tuples) sgd_one(t, a);
}

// ---- sum_squares: one pass over many tensors -------------------------------------------
// The sum of x[b, e)'s squares in f64, read in x's logical order: reduce.cc's
// SumReducer<double>::run additions (16 lanes, folded, then the tail) on the squares, so a
// tensor sums bitwise as sum(cast(x, f64) * cast(x, f64)) does. (Here for this target's
// -ffp-contract=off: a square fused into the addition would round differently.)
template <typename T, typename At>
double squares_lanes(int64_t b, int64_t e, const At& at) {
  constexpr int kLanes = 16;
  double lanes[kLanes] = {};
  int64_t i = b;
  for (; i + kLanes <= e; i += kLanes) {
    double sq[kLanes];
    for (int j = 0; j < kLanes; ++j) sq[j] = at(i + j);
    for (int j = 0; j < kLanes; ++j) lanes[j] += sq[j];
  }
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  }
  double t = lanes[0];
  for (; i < e; ++i) t += at(i);
  return 0.0 + t;
}

template <typename T>
double squares_run(const Tensor& x, int64_t b, int64_t e) {
  const T* base = static_cast<const T*>(x.raw_data());
  const auto square = [](T x) {
    const double v = static_cast<double>(compute_t<T>(x));
    return v * v;
  };
  // The contiguous loop without an index computation per element, so that it vectorizes
  // (the same lanes, so the same additions).
  if (x.is_contiguous()) return squares_lanes<T>(b, e, [&](int64_t i) { return square(base[i]); });
  return squares_lanes<T>(b, e, [&](int64_t i) { return square(base[offset_of(i, x.shape(), x.strides())]); });
}

// Each tensor's sum as sum()'s full reduction of its squares (from kReduceBlockThreshold
// elements, blocks of kReduceBlock added in order), then the tensors' sums in order: bitwise the same for
// any thread count, and what summing each tensor's sum(cast(x, f64) * cast(x, f64)) gives.
// Every (tensor, block) is one part of a single parallel job.
void sum_squares_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  struct Part {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Part> parts;
  std::vector<size_t> first(in.size() + 1, 0);
  for (size_t t = 0; t < in.size(); ++t) {
    first[t] = parts.size();
    const int64_t n = in[t].numel();
    if (n >= kReduceBlockThreshold) {
      for (int64_t b = 0; b < n; b += kReduceBlock) {
        parts.push_back({t, b, std::min(n, b + kReduceBlock)});
      }
    } else {
      parts.push_back({t, 0, n});
    }
  }
  first[in.size()] = parts.size();
  std::vector<double> partial(parts.size(), 0.0);
  parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Part& p = parts[static_cast<size_t>(k)];
      visit_float_dtype(in[p.tensor].dtype(), "sum_squares", [&]<typename T>() {
        partial[static_cast<size_t>(k)] = squares_run<T>(in[p.tensor], p.begin, p.end);
      });
    }
  });
  double total = 0.0;
  for (size_t t = 0; t < in.size(); ++t) {
    double s = partial[first[t]];
    for (size_t k = first[t] + 1; k < first[t + 1]; ++k) s += partial[k];
    total = t == 0 ? s : total + s;
  }
  *static_cast<double*>(out[0].raw_data()) = total;
}

// ---- scale_ -------------------------------------------------------------------------------
// x = x * scale in x's compute type (f32 for f32, f16, bf16: the scale rounded to f32; f64),
// rounded once to x's dtype. Every tensor's chunks are parts of one parallel job.
constexpr int64_t kScaleChunk = int64_t{1} << 16;

template <typename T>
void scale_range(const Tensor& x, int64_t b, int64_t e, double scale) {
  using C = compute_t<T>;
  const C s = static_cast<C>(scale);
  T* base = static_cast<T*>(x.raw_data());
  if (x.is_contiguous()) {
    for (int64_t i = b; i < e; ++i) base[i] = static_cast<T>(static_cast<C>(base[i]) * s);
    return;
  }
  for (int64_t i = b; i < e; ++i) {
    const int64_t off = offset_of(i, x.shape(), x.strides());
    base[off] = static_cast<T>(static_cast<C>(base[off]) * s);
  }
}

void scale_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  struct Part {
    size_t tensor;
    int64_t begin, end;
  };
  std::vector<Part> parts;
  for (size_t t = 0; t < in.size(); ++t) {  // (call_inplace refused expanded layouts)
    const int64_t n = in[t].numel();
    for (int64_t b = 0; b < n; b += kScaleChunk) parts.push_back({t, b, std::min(n, b + kScaleChunk)});
  }
  parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Part& p = parts[static_cast<size_t>(k)];
      visit_float_dtype(in[p.tensor].dtype(), "scale_", [&]<typename T>() {
        scale_range<T>(in[p.tensor], p.begin, p.end, a.scale);
      });
    }
  });
}

TS_REGISTER_KERNEL(cpu, adamw_, adamw_kernel);
TS_REGISTER_KERNEL(cpu, adamw8bit_, adamw8bit_kernel);
TS_REGISTER_KERNEL(cpu, adamw8bit_segments_, adamw8bit_segments_kernel);
TS_REGISTER_KERNEL(cpu, sgd_, sgd_kernel);
TS_REGISTER_KERNEL(cpu, scale_, scale_kernel);
TS_REGISTER_KERNEL(cpu, sum_squares, sum_squares_kernel);

}  // namespace
}  // namespace tessera::cpu
