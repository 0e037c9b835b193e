// Vectorised transcendental runs shared by the CPU kernels (attention's softmax, the
// cross-entropy), through Eigen's packet functions: f32 exp within ~1 ulp of libm's expf,
// a packet of 16 (AVX-512) or 8 (AVX2) lanes per step instead of one libm call per element.
//
//   const float sum = exp_affine(row, row, n, scale, lse);  // row[j] = exp(scale row[j] - lse)
//
// Every element takes the same packet path, the run's tail through a zero-padded packet, so
// an element's bits do not depend on where it lies in the run (nor on the thread count).
// Arguments below Eigen's clamp (-88.72) give exp(-88.72) ~ 3e-39 rather than a smaller
// subnormal or zero; above +88.72, exp(88.72) rather than inf.
#pragma once

#include <Eigen/Core>
#include <cstdint>

namespace tessera::cpu {

// y[j] = exp(a * x[j] - b) for j in [0, n) (x == y allowed); returns the sum of the y[j],
// accumulated per lane and the lanes added in order.
inline float exp_affine(const float* x, float* y, int64_t n, float a, float b) {
  namespace ei = Eigen::internal;
  using Packet = ei::packet_traits<float>::type;
  constexpr int kLanes = ei::packet_traits<float>::size;
  const Packet pa = ei::pset1<Packet>(a), pb = ei::pset1<Packet>(b);
  const auto exp_of = [&](const Packet& v) { return ei::pexp(ei::psub(ei::pmul(pa, v), pb)); };
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

}  // namespace tessera::cpu
