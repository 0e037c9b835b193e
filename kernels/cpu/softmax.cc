// CPU softmax and log_softmax (max-subtracted, so stable for any input). The input is
// viewed as [outer, D, inner] around the softmax dim.
#include <Eigen/Core>
#include <cmath>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

// Sum of a contiguous f32 run: 16 independent lanes (vectorised) over blocks of 1024,
// block totals in f64, so the error stays ~64 ulps of a block whatever the row length.
double sum_f32(const float* p, int64_t n) {
  constexpr int kLanes = 16;
  constexpr int64_t kBlock = 1024;
  double total = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    float lanes[kLanes] = {};
    int64_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) lanes[j] += p[i + j];
    }
    float t = 0;
    for (int j = 0; j < kLanes; ++j) t += lanes[j];
    for (; i < e; ++i) t += p[i];
    total += t;
  }
  return total;
}

// f32 rows: three vectorised passes (max, exp into the output, scale) with Eigen's exp.
template <bool kLog>
void softmax_rows_f32(const float* x, float* y, int64_t rows, int64_t d) {
  using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(d, 1));
  parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      Eigen::Map<const Arr> xr(x + r * d, d);
      Eigen::Map<Arr> yr(y + r * d, d);
      float mx = d > 0 ? xr.maxCoeff() : 0.0f;
      if (!(mx > -std::numeric_limits<float>::infinity())) mx = 0;  // all -inf: no inf - inf
      yr = (xr - mx).exp();
      const double s = sum_f32(y + r * d, d);
      if constexpr (kLog) {
        yr = xr - (mx + static_cast<float>(std::log(s)));
      } else {
        yr *= static_cast<float>(1.0 / s);
      }
    }
  });
}

// Other dtypes (f64 for exactness tests, f16/bf16 through an f32 row buffer): plain loops.
template <typename T, bool kLog>
void softmax_rows(const T* x, T* y, int64_t rows, int64_t d) {
  using C = compute_t<T>;
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(d, 1));
  parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    std::vector<C> buf(d);
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t i = 0; i < d; ++i) mx = std::max<C>(mx, C(xr[i]));
      if (mx == -std::numeric_limits<C>::infinity()) mx = 0;  // all -inf: avoid inf - inf
      double s = 0;
      for (int64_t i = 0; i < d; ++i) {
        buf[i] = std::exp(C(xr[i]) - mx);
        s += buf[i];
      }
      if constexpr (kLog) {
        const C lse = mx + static_cast<C>(std::log(s));
        for (int64_t i = 0; i < d; ++i) yr[i] = T(C(xr[i]) - lse);
      } else {
        const C inv = static_cast<C>(1.0 / s);
        for (int64_t i = 0; i < d; ++i) yr[i] = T(buf[i] * inv);
      }
    }
  });
}

template <typename T, bool kLog>
void softmax_strided(const T* x, T* y, int64_t outer, int64_t d, int64_t inner) {
  using C = compute_t<T>;
  parallel_for(0, outer * inner, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(d, 1)),
               [&](int64_t b, int64_t e) {
    for (int64_t idx = b; idx < e; ++idx) {
      const int64_t o = idx / inner, j = idx % inner;
      const T* xr = x + o * d * inner + j;
      T* yr = y + o * d * inner + j;
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t i = 0; i < d; ++i) mx = std::max<C>(mx, C(xr[i * inner]));
      if (mx == -std::numeric_limits<C>::infinity()) mx = 0;
      double s = 0;
      for (int64_t i = 0; i < d; ++i) s += std::exp(C(xr[i * inner]) - mx);
      if constexpr (kLog) {
        const C lse = mx + static_cast<C>(std::log(s));
        for (int64_t i = 0; i < d; ++i) yr[i * inner] = T(C(xr[i * inner]) - lse);
      } else {
        const C inv = static_cast<C>(1.0 / s);
        for (int64_t i = 0; i < d; ++i) yr[i * inner] = T(std::exp(C(xr[i * inner]) - mx) * inv);
      }
    }
  });
}

template <bool kLog>
void softmax_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const int64_t dim = normalize_dim(kLog ? "log_softmax" : "softmax", a.dim, x.dim());
  int64_t outer = 1, inner = 1;
  const int64_t d = x.dim() == 0 ? 1 : x.shape()[dim];
  for (int64_t i = 0; i < dim; ++i) outer *= x.shape()[i];
  for (int64_t i = dim + 1; i < x.dim(); ++i) inner *= x.shape()[i];
  visit_float_dtype(x.dtype(), "softmax", [&]<typename T>() {
    const T* xp = static_cast<const T*>(x.raw_data());
    T* yp = static_cast<T*>(out[0].raw_data());
    if constexpr (std::is_same_v<T, float>) {
      if (inner == 1) return softmax_rows_f32<kLog>(xp, yp, outer, d);
    }
    if (inner == 1) softmax_rows<T, kLog>(xp, yp, outer, d);
    else softmax_strided<T, kLog>(xp, yp, outer, d, inner);
  });
}

TS_REGISTER_KERNEL(cpu, softmax, softmax_kernel<false>);
TS_REGISTER_KERNEL(cpu, log_softmax, softmax_kernel<true>);

}  // namespace
}  // namespace tessera::cpu
