// CPU copies and fills: copy_ (any dtype pair, broadcasting, any strides), cast, clone,
// to_device (cpu -> cpu), cat, full, arange.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "kernels/cpu/loops.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {

void widen_run(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  // A lane is NaN when its magnitude bits exceed infinity's (0x7c00): a signed 16-bit compare
  // of the masked values, which are below 0x8000.
  const __m128i magnitude = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, magnitude), inf)) != 0) {
      for (int64_t j = i; j < i + 8; ++j) dst[j] = static_cast<float>(src[j]);
      continue;
    }
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void widen_run(const BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

void narrow_run(const float* src, Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {
      for (int64_t j = i; j < i + 8; ++j) dst[j] = Half(src[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) dst[i] = Half(src[i]);
}

void narrow_run(const float* src, BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16(src[i]);
}

namespace {

template <typename To, typename From>
To convert(From v) {
  if constexpr (std::is_same_v<To, bool>) {
    // Compared in the source type: a tiny f64 is nonzero even where f32 would flush it.
    if constexpr (is_low_precision_v<From>) return static_cast<float>(v) != 0.0f;
    else return v != From(0);
  } else if constexpr (is_low_precision_v<To>) {
    // f64 and integers (exact in f64 below 2^53) round once, correctly, to f16/bf16.
    if constexpr (std::is_same_v<From, double> || std::is_integral_v<From>) {
      return To(static_cast<double>(v));  // rounds once (dtype.h)
    } else {
      return To(static_cast<float>(v));
    }
  } else if constexpr (std::is_same_v<To, uint8_t> && !std::is_integral_v<From>) {
    // Floats truncate toward zero, then wrap modulo 256 as integers do.
    return static_cast<uint8_t>(static_cast<int64_t>(static_cast<compute_t<From>>(v)));
  } else if constexpr (is_low_precision_v<From>) {
    return static_cast<To>(static_cast<float>(v));
  } else {
    return static_cast<To>(v);
  }
}

}  // namespace

void copy_cpu(const Tensor& dst, const Tensor& src) {
  visit_dtype(dst.dtype(), [&]<typename D>() {
    visit_dtype(src.dtype(), [&]<typename S>() {
      for_each_run(operands_for<2>(dst, {src}), [&](const Run<2>& r) {
        D* o = reinterpret_cast<D*>(r.ptr[0]);
        const S* a = reinterpret_cast<const S*>(r.ptr[1]);
        if constexpr (std::is_same_v<D, S>) {
          if (r.stride[0] == sizeof(D) && r.stride[1] == sizeof(S)) {
            std::memcpy(o, a, r.n * sizeof(D));
            return;
          }
        }
        const int64_t so = r.stride[0] / int64_t(sizeof(D)), sa = r.stride[1] / int64_t(sizeof(S));
        if (so == 1 && sa == 1) {
          // 16-bit <-> f32: the run helpers above (convert's bits, F16C for f16).
          if constexpr (std::is_same_v<D, float> && is_low_precision_v<S>) return widen_run(a, o, r.n);
          if constexpr (is_low_precision_v<D> && std::is_same_v<S, float>) return narrow_run(a, o, r.n);
          for (int64_t i = 0; i < r.n; ++i) o[i] = convert<D>(a[i]);
        } else {
          for (int64_t i = 0; i < r.n; ++i) o[i * so] = convert<D>(a[i * sa]);
        }
      });
    });
  });
}

Tensor contiguous_cpu(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  copy_cpu(out, t);
  return out;
}

Tensor to_compute_cpu(const Tensor& t) {
  if (t.dtype() == DType::f16 || t.dtype() == DType::bf16) {
    Tensor out = Tensor::empty(t.shape(), DType::f32, t.device());
    copy_cpu(out, t);
    return out;
  }
  return contiguous_cpu(t);
}

Tensor to_compute_any_layout_cpu(const Tensor& t) {
  if (t.dtype() != DType::f16 && t.dtype() != DType::bf16) return t;
  if (t.is_contiguous()) return to_compute_cpu(t);
  // t filling its span densely in another order of its dims: widened in that order.
  const std::vector<int64_t> order = dense_order(t.shape(), t.strides());
  if (order.empty()) return to_compute_cpu(t);
  Shape shape;
  Strides strides;
  for (const int64_t d : order) {
    shape.push_back(t.shape()[d]);
    strides.push_back(t.strides()[d]);
  }
  const Tensor dense = Tensor::from_storage(t.storage(), shape, strides, t.offset(), t.dtype());
  const Tensor wide = Tensor::empty(shape, DType::f32, t.device());
  copy_cpu(wide, dense);
  Strides back(static_cast<size_t>(t.dim()));
  for (size_t k = 0; k < order.size(); ++k) back[static_cast<size_t>(order[k])] = wide.strides()[k];
  return Tensor::from_storage(wide.storage(), t.shape(), back, 0, DType::f32);
}

namespace {

void copy_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  copy_cpu(out[0], in[1]);
}

// cast, clone and cpu->cpu to_device all copy input 0 into the fresh output.
void copy_into_output(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  copy_cpu(out[0], in[0]);
}

void cat_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& o = out[0];
  const int64_t d = normalize_dim("cat", a.dim, o.dim());
  int64_t start = 0;
  for (const Tensor& t : in) {
    const int64_t len = t.shape()[d];
    if (len == 0) continue;
    Strides strides = o.strides();
    Tensor dst = Tensor::from_storage(o.storage(), t.shape(), strides,
                                      o.offset() + start * o.strides()[d], o.dtype());
    copy_cpu(dst, t);
    start += len;
  }
}

void full_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  visit_dtype(out[0].dtype(), [&]<typename T>() {
    const T v = convert<T>(a.value);
    T* p = static_cast<T*>(out[0].raw_data());
    parallel_for(0, out[0].numel(), kElementwiseGrain, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) p[i] = v;
    });
  });
}

void arange_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  visit_dtype(out[0].dtype(), [&]<typename T>() {
    T* p = static_cast<T*>(out[0].raw_data());
    const int64_t n = out[0].numel();
    for (int64_t i = 0; i < n; ++i) p[i] = convert<T>(a.range_start + a.range_step * static_cast<double>(i));
  });
}

TS_REGISTER_KERNEL(cpu, copy_, copy_kernel);
TS_REGISTER_KERNEL(cpu, cast, copy_into_output);
TS_REGISTER_KERNEL(cpu, clone, copy_into_output);
TS_REGISTER_KERNEL(cpu, to_device, copy_into_output);
TS_REGISTER_KERNEL(cpu, cat, cat_kernel);
TS_REGISTER_KERNEL(cpu, full, full_kernel);
TS_REGISTER_KERNEL(cpu, arange, arange_kernel);

}  // namespace
}  // namespace tessera::cpu
