// The scalar math of the elementwise ops, once for the CPU (GCC) and CUDA (nvcc): each
// functor family op of tensor/op_list.h has a functor of the same name here, which the CPU
// loops (kernels/cpu/elementwise.cc) and the CUDA skeleton (kernels/cuda/elementwise.cu)
// instantiate for every dtype the op takes. C is the compute type: float for f32, f16 and
// bf16 (rounded once to the output), double for f64, the integer type for integers.
//
//   struct silu {  // a new UnaryFloat op: this, its line in TS_UNARY_OPS, a derivative
//     template <typename C> TS_HD C operator()(C x) const { return x / (C(1) + math::exp(-x)); }
//   };
//
// No fast-math approximations: the functions below are the correctly rounded (or libm/CUDA
// few-ulp) ones on both sides, so a CUDA result is within a few ulps of the CPU's.
#pragma once

#include <cmath>
#include <type_traits>

#ifdef __CUDACC__
#define TS_HD __host__ __device__ __forceinline__
#else
#define TS_HD inline
#endif

namespace tessera::scalar_ops {

namespace math {
template <typename C> TS_HD C exp(C x) {
  if constexpr (std::is_same_v<C, float>) return ::expf(x); else return ::exp(x);
}
template <typename C> TS_HD C log(C x) {
  if constexpr (std::is_same_v<C, float>) return ::logf(x); else return ::log(x);
}
template <typename C> TS_HD C sqrt(C x) {
  if constexpr (std::is_same_v<C, float>) return ::sqrtf(x); else return ::sqrt(x);
}
template <typename C> TS_HD C tanh(C x) {
  if constexpr (std::is_same_v<C, float>) return ::tanhf(x); else return ::tanh(x);
}
template <typename C> TS_HD C erf(C x) {
  if constexpr (std::is_same_v<C, float>) return ::erff(x); else return ::erf(x);
}
template <typename C> TS_HD C pow(C a, C b) {
  if constexpr (std::is_same_v<C, float>) return ::powf(a, b); else return ::pow(a, b);
}
template <typename C> TS_HD C fabs(C x) {
  if constexpr (std::is_same_v<C, float>) return ::fabsf(x); else return ::fabs(x);
}
template <typename C> TS_HD bool is_nan(C x) {
  if constexpr (std::is_floating_point_v<C>) return x != x; else return false;
}
}  // namespace math

inline constexpr double kSqrt1_2 = 0.70710678118654752440;
inline constexpr double kSqrt2OverPi = 0.79788456080286535588;
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;
inline constexpr double kGeluCoeff = 0.044715;

// ---- UnaryNumeric and UnaryFloat ---------------------------------------------------------

struct neg {
  template <typename C> TS_HD C operator()(C x) const { return -x; }
};
struct abs {
  template <typename C> TS_HD C operator()(C x) const {
    if constexpr (std::is_floating_point_v<C>) return math::fabs(x);  // abs(-0.0) = +0.0
    else return x < C(0) ? C(-x) : x;
  }
};
struct relu {
  template <typename C> TS_HD C operator()(C x) const {
    if (math::is_nan(x)) return x;  // NaN propagates, as in PyTorch
    return x > C(0) ? x : C(0);
  }
};
struct exp {
  template <typename C> TS_HD C operator()(C x) const { return math::exp(x); }
};
struct log {
  template <typename C> TS_HD C operator()(C x) const { return math::log(x); }
};
struct sqrt {
  template <typename C> TS_HD C operator()(C x) const { return math::sqrt(x); }
};
// A correctly rounded division of a correctly rounded sqrt (CUDA's rsqrtf is 2 ulp).
struct rsqrt {
  template <typename C> TS_HD C operator()(C x) const { return C(1) / math::sqrt(x); }
};
struct tanh {
  template <typename C> TS_HD C operator()(C x) const { return math::tanh(x); }
};
// exp keeps small outputs relatively accurate (x < -7), where a logistic that is accurate
// only in absolute terms loses them.
struct sigmoid {
  template <typename C> TS_HD C operator()(C x) const { return C(1) / (C(1) + math::exp(-x)); }
};

// x * sigmoid(x); below 0 through exp(x), which underflows gradually where exp(-x) would
// overflow (f32 x near -89 gave 0 instead of -2e-37).
struct silu {
  template <typename C> TS_HD C operator()(C x) const {
    if (x < C(0)) {
      const C e = math::exp(x);
      return x * e / (C(1) + e);
    }
    return x / (C(1) + math::exp(-x));
  }
};

// gelu (an op with an attribute, so outside the functor families): both forms and their
// derivatives times the incoming gradient.
struct gelu_erf {
  template <typename C> TS_HD C operator()(C x) const {
    return C(0.5) * x * (C(1) + math::erf(x * C(kSqrt1_2)));
  }
};
struct gelu_tanh {
  template <typename C> TS_HD C operator()(C x) const {
    return C(0.5) * x * (C(1) + math::tanh(C(kSqrt2OverPi) * (x + C(kGeluCoeff) * x * x * x)));
  }
};
struct gelu_erf_backward {
  template <typename C> TS_HD C operator()(C g, C x) const {
    const C cdf = C(0.5) * (C(1) + math::erf(x * C(kSqrt1_2)));
    const C pdf = C(kInvSqrt2Pi) * math::exp(C(-0.5) * x * x);
    return g * (cdf + x * pdf);
  }
};
struct gelu_tanh_backward {
  template <typename C> TS_HD C operator()(C g, C x) const {
    const C x2 = x * x;
    const C t = math::tanh(C(kSqrt2OverPi) * (x + C(kGeluCoeff) * x2 * x));
    const C dt = C(kSqrt2OverPi) * (C(1) + C(3 * kGeluCoeff) * x2) * (C(1) - t * t);
    return g * (C(0.5) * (C(1) + t) + C(0.5) * x * dt);
  }
};

// ---- Binary and BinaryFloat --------------------------------------------------------------

struct add {
  template <typename C> TS_HD C operator()(C a, C b) const { return a + b; }
};
struct sub {
  template <typename C> TS_HD C operator()(C a, C b) const { return a - b; }
};
struct mul {
  template <typename C> TS_HD C operator()(C a, C b) const { return a * b; }
};
struct div {
  template <typename C> TS_HD C operator()(C a, C b) const { return a / b; }
};
// Integers: exact repeated squaring. A negative exponent gives what 1 / a^-b truncates to
// (1 for a = 1, +-1 for a = -1, else 0; 0 for a = 0 too), as PyTorch's CUDA kernel does:
// a kernel cannot throw, and the CPU and CUDA give the same values.
struct pow {
  template <typename C> TS_HD C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      if (b < 0) {
        if (a == 1) return C(1);
        if (a == -1) return (b & 1) ? C(-1) : C(1);
        return C(0);
      }
      C r = 1;
      for (C e = b, base = a; e > 0; e >>= 1, base *= base) {
        if (e & 1) r *= base;
      }
      return r;
    } else {
      return math::pow(a, b);
    }
  }
};
// NaN propagates, as in PyTorch's maximum/minimum.
struct maximum {
  template <typename C> TS_HD C operator()(C a, C b) const {
    if (math::is_nan(a) || math::is_nan(b)) return a + b;
    return a > b ? a : b;
  }
};
struct minimum {
  template <typename C> TS_HD C operator()(C a, C b) const {
    if (math::is_nan(a) || math::is_nan(b)) return a + b;
    return a < b ? a : b;
  }
};

// ---- Compare (bool results) ----------------------------------------------------------------

struct eq {
  template <typename C> TS_HD bool operator()(C a, C b) const { return a == b; }
};
struct ne {
  template <typename C> TS_HD bool operator()(C a, C b) const { return a != b; }
};
struct lt {
  template <typename C> TS_HD bool operator()(C a, C b) const { return a < b; }
};
struct le {
  template <typename C> TS_HD bool operator()(C a, C b) const { return a <= b; }
};
struct gt {
  template <typename C> TS_HD bool operator()(C a, C b) const { return a > b; }
};
struct ge {
  template <typename C> TS_HD bool operator()(C a, C b) const { return a >= b; }
};

}  // namespace tessera::scalar_ops
