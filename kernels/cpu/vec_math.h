// Vectorised transcendental runs shared by the CPU kernels (attention's softmax, the
// cross-entropy), through Eigen's packet functions: f32 exp (accuracy below),
// a packet of 16 (AVX-512) or 8 (AVX2) lanes per step instead of one libm call per element.
//
//   const float sum = exp_affine(row, row, n, scale, lse);  // row[j] = exp(scale row[j] - lse)
//   const float mx = extreme_of(row, n, /*largest=*/true);   // max_j row[j]
//
// Every element takes the same packet path, the run's tail through a zero-padded packet, so
// an element's bits do not depend on where it lies in the run (nor on the thread count).
// Accuracy: within 1.3 ulps of the true exp (libm's expf: 0.5), through Eigen's generic
// float form (two-constant range reduction) with AVX-512 and AVX2 (--config=portable) alike:
// Eigen's own AVX-512 form is off by up to 4.5 ulps, which showed in training (an 8-bit
// AdamW run on tp drifted from one device's past its bound). Arguments below -87.33 (results
// under FLT_MIN, subnormal) give 0, above 88.72 (past FLT_MAX) inf, and NaN stays NaN.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <limits>

namespace tessera::cpu {

// y[j] = exp(a * x[j] - b) for j in [0, n) (x == y allowed); returns the sum of the y[j],
// accumulated per lane and the lanes added in order.
inline float exp_affine(const float* x, float* y, int64_t n, float a, float b) {
  namespace ei = Eigen::internal;
  using Packet = ei::packet_traits<float>::type;
  constexpr int kLanes = ei::packet_traits<float>::size;
  const Packet pa = ei::pset1<Packet>(a), pb = ei::pset1<Packet>(b);
  // The form clamps its argument to [-88.72, 88.72] (exp(-inf) would be 3e-39): the ends
  // are pinned to 0 and inf.
  const Packet lo = ei::pset1<Packet>(-87.33654f), hi = ei::pset1<Packet>(88.72283f);
  const Packet zero = ei::pset1<Packet>(0.0f);
  const Packet inf = ei::pset1<Packet>(std::numeric_limits<float>::infinity());
  const auto exp_of = [&](const Packet& v) {
    const Packet arg = ei::psub(ei::pmul(pa, v), pb);
    const Packet e = ei::pexp_float(arg);
    return ei::pselect(ei::pcmp_lt(hi, arg), inf, ei::pselect(ei::pcmp_lt(arg, lo), zero, e));
  };
  Packet acc = ei::pset1<Packet>(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Packet e = exp_of(ei::ploadu<Packet>(x + j));
    ei::pstoreu(y + j, e);
    acc = ei::padd(acc, e);
  }
  alignas(64) float lanes[kLanes];
  if (j < n) {
    const int64_t m = n - j;
    for (int64_t i = 0; i < kLanes; ++i) lanes[i] = i < m ? x[j + i] : 0.0f;
    ei::pstore(lanes, exp_of(ei::pload<Packet>(lanes)));
    for (int64_t i = m; i < kLanes; ++i) lanes[i] = 0.0f;  // the padding adds nothing
    for (int64_t i = 0; i < m; ++i) y[j + i] = lanes[i];
    acc = ei::padd(acc, ei::pload<Packet>(lanes));
  }
  ei::pstore(lanes, acc);
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}

// The largest (largest == true) or smallest x[j] for j in [0, n), through Eigen's vectorised
// reduction as softmax.cc's rows (a max is exact, so the order cannot change it, ties of +0
// and -0 aside); -inf or +inf when n == 0. With a NaN among the x[j] the result may or may
// not be NaN.
inline float extreme_of(const float* x, int64_t n, bool largest) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  if (n <= 0) return largest ? -kInf : kInf;
  const Eigen::Map<const Eigen::ArrayXf> row(x, n);
  return largest ? row.maxCoeff() : row.minCoeff();
}

}  // namespace tessera::cpu
