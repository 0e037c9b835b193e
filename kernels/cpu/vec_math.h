// Vectorised transcendental runs shared by the CPU kernels (attention's softmax, the
// cross-entropy), through Eigen's packet functions: f32 exp (accuracy below),
// a packet of 16 (AVX-512) or 8 (AVX2) lanes per step instead of one libm call per element.
//
//   const float sum = exp_affine(row, row, n, scale, lse);  // row[j] = exp(scale row[j] - lse)
//   const float mx = extreme_of(row, n, /*largest=*/true);   // max_j row[j]
//
// Every element takes the same packet path, the run's tail through a zero-padded packet
// (a masked load and store where Eigen has them: AVX and AVX-512 builds), so an element's
// bits do not depend on where it lies in the run (nor on the thread count).
// Accuracy: within 1.3 ulps of the true exp (libm's expf: 0.5), with the bits of Eigen's
// generic float form (two-constant range reduction; exp_in_range below, vec_math_test checks
// the bits) with AVX-512 and AVX2 (--config=portable) alike:
// Eigen's own AVX-512 form is off by up to 4.5 ulps, which showed in training (an 8-bit
// AdamW run on tp drifted from one device's past its bound). Arguments below -87.33 (results
// under FLT_MIN, subnormal) give 0, above 88.72 (past FLT_MAX) inf, and NaN stays NaN.
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <limits>

namespace tessera::cpu {

namespace vec_math_internal {

// exp(x) for x in [-87.33654, 88.72283]: Eigen's generic pexp_float (Eigen 3.4,
// GenericPacketMathFunctions.h) step for step - the same constants, range reduction and
// polynomial, so the same bits - less what exp_affine does not need. Its clamp and final
// max(result, x) change nothing in that range (exp(x) > x), and its general ldexp (four
// factors, for any exponent) becomes two: m lies in [-126, 128], so 2^(m >> 1) and
// 2^(m - (m >> 1)) are both normal, y * 2^(m >> 1) is exact, and the one rounding is the
// last product's, as in Eigen's. Outside that range the result is garbage that exp_affine
// replaces (0 or inf); NaN gives NaN (every step propagates it).
template <typename Packet>
Packet exp_in_range(const Packet& x) {
  namespace ei = Eigen::internal;
  using PacketI = typename ei::unpacket_traits<Packet>::integer_packet;
  const Packet m = ei::pfloor(ei::pmadd(x, ei::pset1<Packet>(1.44269504088896341f), ei::pset1<Packet>(0.5f)));
  Packet r = ei::pmadd(m, ei::pset1<Packet>(-0.693359375f), x);
  r = ei::pmadd(m, ei::pset1<Packet>(2.12194440e-4f), r);
  const Packet r2 = ei::pmul(r, r);
  const Packet r3 = ei::pmul(r2, r);
  Packet y = ei::pmadd(ei::pset1<Packet>(1.9875691500E-4f), r, ei::pset1<Packet>(1.3981999507E-3f));
  Packet y1 = ei::pmadd(ei::pset1<Packet>(4.1665795894E-2f), r, ei::pset1<Packet>(1.6666665459E-1f));
  const Packet y2 = ei::padd(r, ei::pset1<Packet>(1.0f));
  y = ei::pmadd(y, r, ei::pset1<Packet>(8.3334519073E-3f));
  y1 = ei::pmadd(y1, r, ei::pset1<Packet>(5.0000001201E-1f));
  y = ei::pmadd(y, r3, y1);
  y = ei::pmadd(y, r2, y2);
  const PacketI e = ei::pcast<Packet, PacketI>(m);
  const PacketI half = ei::parithmetic_shift_right<1>(e);
  const PacketI bias = ei::pset1<PacketI>(127);
  const Packet s1 = ei::preinterpret<Packet>(ei::plogical_shift_left<23>(ei::padd(half, bias)));
  const Packet s2 = ei::preinterpret<Packet>(ei::plogical_shift_left<23>(ei::padd(ei::psub(e, half), bias)));
  return ei::pmul(ei::pmul(y, s1), s2);
}

template <typename Packet>
float exp_affine(const float* x, float* y, int64_t n, float a, float b) {
  namespace ei = Eigen::internal;
  constexpr int kLanes = ei::unpacket_traits<Packet>::size;
  const Packet pa = ei::pset1<Packet>(a), pb = ei::pset1<Packet>(b);
  // Below -87.33 the result would be subnormal, above 88.72 past FLT_MAX: pinned to 0 and
  // inf.
  const Packet lo = ei::pset1<Packet>(-87.33654f), hi = ei::pset1<Packet>(88.72283f);
  const Packet zero = ei::pset1<Packet>(0.0f);
  const Packet inf = ei::pset1<Packet>(std::numeric_limits<float>::infinity());
  const auto exp_of = [&](const Packet& v) {
    const Packet arg = ei::psub(ei::pmul(pa, v), pb);
    Packet e;
    if constexpr (kLanes == 1) {
      e = ei::pexp_float(arg);  // a build without SIMD (EIGEN_DONT_VECTORIZE): no integer packet
    } else {
      e = vec_math_internal::exp_in_range(arg);
    }
    return ei::pselect(ei::pcmp_lt(hi, arg), inf, ei::pselect(ei::pcmp_lt(arg, lo), zero, e));
  };
  Packet acc = ei::pset1<Packet>(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Packet e = exp_of(ei::ploadu<Packet>(x + j));
    ei::pstoreu(y + j, e);
    acc = ei::padd(acc, e);
  }
  if (j < n) {
    const int m = static_cast<int>(n - j);
    if constexpr (ei::unpacket_traits<Packet>::masked_load_available &&
                  ei::unpacket_traits<Packet>::masked_store_available) {
      using Mask = typename ei::unpacket_traits<Packet>::mask_t;
      const Mask mask = static_cast<Mask>((1u << m) - 1u);
      const Packet e = exp_of(ei::ploadu<Packet>(x + j, mask));
      ei::pstoreu(y + j, e, mask);
      // The padding lanes' exp(-b) is left out of the sum.
      const Packet valid = ei::pcmp_lt(ei::plset<Packet>(0.0f), ei::pset1<Packet>(static_cast<float>(m)));
      acc = ei::padd(acc, ei::pand(e, valid));
    } else {
      alignas(64) float lanes[kLanes];
      for (int i = 0; i < kLanes; ++i) lanes[i] = i < m ? x[j + i] : 0.0f;
      ei::pstore(lanes, exp_of(ei::pload<Packet>(lanes)));
      for (int i = m; i < kLanes; ++i) lanes[i] = 0.0f;  // the padding adds nothing
      for (int i = 0; i < m; ++i) y[j + i] = lanes[i];
      acc = ei::padd(acc, ei::pload<Packet>(lanes));
    }
  }
  alignas(64) float lanes[kLanes];
  ei::pstore(lanes, acc);
  float s = 0;
  for (int i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}

}  // namespace vec_math_internal

// y[j] = exp(a * x[j] - b) for j in [0, n) (x == y allowed); returns the sum of the y[j],
// accumulated per lane and the lanes added in order. The run's tail is one packet (masked
// where the packet type allows, else through a stack copy), its padding lanes read as 0
// and adding 0.
inline float exp_affine(const float* x, float* y, int64_t n, float a, float b) {
  return vec_math_internal::exp_affine<Eigen::internal::packet_traits<float>::type>(x, y, n, a, b);
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
