// Shared by the GPU kernel suites: a result on cuda:0 against the CPU kernel's (the spec),
// element by element within a relative and an absolute tolerance.
//
//   check_close(exp(x.to(kGpu)), exp(x), "exp f32", Tol{1e-5, 1e-6});
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::cuda_testing {

inline const Device kGpu = cuda(0);

struct Tol {
  double rel, abs;
};

// `got` (on the GPU) equals `want` (on the CPU): NaN where want is NaN, infinities exactly,
// else |got - want| <= rel * |want| + abs. Reports how many differ and the first.
inline void check_close(const Tensor& got, const Tensor& want, const std::string& what, Tol tol) {
  INFO(what);
  REQUIRE(got.device() == kGpu);
  REQUIRE(got.dtype() == want.dtype());
  REQUIRE(got.shape() == want.shape());
  const std::vector<double> g = got.to(kCPU).to_vector<double>();
  const std::vector<double> w = want.to_vector<double>();
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) && std::isnan(w[i])) continue;
    const bool ok = std::isinf(w[i]) ? g[i] == w[i]
                                     : std::fabs(g[i] - w[i]) <= tol.rel * std::fabs(w[i]) + tol.abs;
    if (!ok && bad++ == 0) first = static_cast<int64_t>(i);
  }
  CHECK_MESSAGE(bad == 0, bad << " of " << g.size() << " differ; first at " << first << ": got "
                                << (first >= 0 ? g[first] : 0.0) << ", want "
                                << (first >= 0 ? w[first] : 0.0));
}

}  // namespace tessera::cuda_testing
