// kernels/cpu/vec_math.h: exp_affine against libm's exp in f64, the sum it returns, and the
// same bits for a value at every position of runs of every length (tails included).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/vec_math.h"

namespace tessera::cpu {
namespace {

// Units in the last place between a float result and the f64 truth.
double ulps(float got, double want) {
  const double spacing = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
  return std::abs(static_cast<double>(got) - want) / spacing;
}

TEST_CASE("exp_affine: within 1.3 ulps of exp over [-87.3, 88.7], and the affine argument") {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> dist(-87.3f, 88.7f);
  std::vector<float> x(100003), y(x.size());
  for (float& v : x) v = dist(gen);
  exp_affine(x.data(), y.data(), static_cast<int64_t>(x.size()), 1.0f, 0.0f);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, ulps(y[i], std::exp(static_cast<double>(x[i]))));
  }
  CHECK(worst <= 1.3);
  // a = 0.5 makes a x exact, so the argument rounds once (in - b) however it is compiled.
  std::vector<float> z(4099), w(z.size());
  std::uniform_real_distribution<float> small(-150.0f, 20.0f);
  for (float& v : z) v = small(gen);
  const float sum = exp_affine(z.data(), w.data(), static_cast<int64_t>(z.size()), 0.5f, 3.5f);
  double want_sum = 0;
  worst = 0;
  for (size_t i = 0; i < z.size(); ++i) {
    const double want = std::exp(static_cast<double>(0.5f * z[i] - 3.5f));
    want_sum += want;
    worst = std::max(worst, ulps(w[i], want));
  }
  CHECK(worst <= 1.3);
  // Positive terms summed in f32 lanes: each addition rounds once (2^-24 relative), and a
  // lane adds at most 4099 of them.
  CHECK(std::abs(sum - want_sum) <= 4099 * 6e-8 * want_sum);
}

TEST_CASE("exp_affine: an element's bits do not depend on its position or the run's length") {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-20.0f, 5.0f);
  std::vector<float> values(64);
  for (float& v : values) v = dist(gen);
  std::vector<float> reference(values.size());
  exp_affine(values.data(), reference.data(), static_cast<int64_t>(values.size()), 1.0f, 0.5f);
  int checked = 0;
  for (int64_t n = 0; n <= 40; ++n) {
    for (int64_t shift = 0; shift < 17; ++shift) {
      // values[shift, shift + n) as a run of its own, starting at an arbitrary alignment.
      std::vector<float> in(values.begin() + shift, values.begin() + shift + n), out(n, -1.0f);
      const float sum = exp_affine(in.data(), out.data(), n, 1.0f, 0.5f);
      double total = 0;
      for (int64_t i = 0; i < n; ++i) {
        CHECK(std::memcmp(&out[i], &reference[shift + i], sizeof(float)) == 0);
        total += out[i];
        ++checked;
      }
      if (n == 0) CHECK(sum == 0.0f);
      CHECK(std::abs(sum - total) <= 1e-6 * total);
    }
  }
  CHECK(checked == 17 * (40 * 41 / 2));
}

TEST_CASE("exp_affine: in place; zero, one, the ends and NaN as vec_math.h states") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> x{0.0f,   -1.0f, 1.0f,      -87.3f,    -87.4f, -100.0f,
                       -inf,   88.72283f, 88.72284f, inf, nan};
  exp_affine(x.data(), x.data(), static_cast<int64_t>(x.size()), 1.0f, 0.0f);
  CHECK(x[0] == 1.0f);
  CHECK(ulps(x[1], std::exp(-1.0)) <= 1.3);
  CHECK(ulps(x[2], std::exp(1.0)) <= 1.3);
  CHECK(ulps(x[3], std::exp(double{-87.3f})) <= 1.3);  // the smallest normal results
  CHECK(x[4] == 0.0f);                        // subnormal results are 0
  CHECK(x[5] == 0.0f);
  CHECK(x[6] == 0.0f);
  CHECK(ulps(x[7], std::exp(double{88.72283f})) <= 1.3);  // the largest finite results
  CHECK(x[8] == inf);                                     // past FLT_MAX
  CHECK(x[9] == inf);
  CHECK(std::isnan(x[10]));
}

TEST_CASE("exp_affine: the bits of Eigen's generic pexp_float over the whole range") {
  // vec_math.h's exp is Eigen's generic form with a shorter ldexp; every float in
  // [-87.33654, 88.72283] must keep Eigen's bits. One bit pattern in 1,021 of each sign
  // (every exponent, many mantissas), the range's ends, the top where 2^m needs both of its
  // factors (m = 128: x above 88.37) and the bottom's m = -126.
  namespace ei = Eigen::internal;
  using Packet = ei::packet_traits<float>::type;
  constexpr int kLanes = ei::packet_traits<float>::size;
  constexpr float kLo = -87.33654f, kHi = 88.72283f;
  std::vector<float> x;
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 1021) {
    float v;
    std::memcpy(&v, &bits, sizeof v);
    if (v <= kHi) x.push_back(v);
    if (-v >= kLo) x.push_back(-v);
  }
  for (float v : {kLo, kHi, std::nextafter(kLo, 0.0f), std::nextafter(kHi, 0.0f), 88.5f, 88.38f,
                  88.37f, -87.0f, -87.3f, 0.0f, -0.0f, 1e-30f, -1e-30f}) {
    x.push_back(v);
  }
  const size_t sampled = x.size();
  while (x.size() % kLanes != 0) x.push_back(1.0f);
  std::vector<float> got(x.size()), want(x.size());
  exp_affine(x.data(), got.data(), static_cast<int64_t>(x.size()), 1.0f, 0.0f);
  for (size_t i = 0; i < x.size(); i += kLanes) {
    ei::pstoreu(want.data() + i, ei::pexp_float(ei::ploadu<Packet>(x.data() + i)));
  }
  size_t differ = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      if (++differ <= 5) MESSAGE("x = " << x[i] << ": " << got[i] << " against Eigen's " << want[i]);
    }
  }
  CHECK(sampled == 2191659);  // the sample above, fixed by the range and the stride
  CHECK(differ == 0);
}

TEST_CASE("extreme_of: the max and min of a run against a scalar fold, every length to 70") {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> dist(-50.0f, 50.0f);
  int64_t runs = 0;
  for (int64_t n = 0; n <= 70; ++n) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = dist(gen);
    // The extreme at every position in turn, so a lane or the tail holds it.
    for (int64_t at = 0; at < std::max<int64_t>(n, 1); ++at) {
      std::vector<float> y = x;
      if (n > 0) y[at] = at % 2 ? 1e30f : -1e30f;
      float mx = -std::numeric_limits<float>::infinity(), mn = std::numeric_limits<float>::infinity();
      for (float v : y) {
        mx = std::max(mx, v);
        mn = std::min(mn, v);
      }
      CAPTURE(n);
      CAPTURE(at);
      CHECK(extreme_of(y.data(), n, true) == mx);
      CHECK(extreme_of(y.data(), n, false) == mn);
      ++runs;
    }
  }
  CHECK(runs == 1 + 70 * 71 / 2);
  // Infinities are values like any other.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> z = {1, 2, 3, 4, 5, 6, 7, 8, 9, -inf, 11, 12, 13, 14, 15, 16, inf};
  CHECK(extreme_of(z.data(), 17, true) == inf);
  CHECK(extreme_of(z.data(), 17, false) == -inf);
  CHECK(extreme_of(z.data(), 16, true) == 16.0f);
}

}  // namespace
}  // namespace tessera::cpu
