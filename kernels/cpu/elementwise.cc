// CPU elementwise kernels: unary, binary (broadcasting), comparisons, where, gelu_backward.
// Contiguous f32/f64 runs of transcendental ops go through Eigen's vectorised array
// functions; everything else is a plain loop the compiler vectorises on contiguous runs.
#include <cmath>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/loops.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kGeluCoeff = 0.044715;

// ---- unary functors: scalar form on the compute type, optional Eigen array form ----------

struct Neg {
  template <typename C> C operator()(C x) const { return -x; }
};
struct Abs {
  template <typename C> C operator()(C x) const {
    if constexpr (std::is_floating_point_v<C>) return std::fabs(x);  // abs(-0.0) = +0.0
    else return x < C(0) ? C(-x) : x;
  }
};
struct Relu {
  template <typename C> C operator()(C x) const {
    if constexpr (std::is_floating_point_v<C>) {
      if (x != x) return x;  // NaN propagates, as on the Eigen path and in PyTorch
    }
    return x > C(0) ? x : C(0);
  }
  // No Eigen form: the plain loop vectorises, and propagates NaN by construction.
};
struct Exp {
  template <typename C> C operator()(C x) const { return std::exp(x); }
  // f32 only: Eigen 3.4's double exp clamps its argument at -709.4, so exp(-inf) and
  // exp(x < -709.4) gave 5.6e-309 instead of 0 / the true subnormal.
  template <typename A>
    requires std::is_same_v<typename A::Scalar, float>
  auto eigen(const A& a) const { return a.exp(); }
};
// No Eigen form: Eigen 3.4's log clamps subnormal inputs to the smallest normal, so
// log(1e-40f) gave -87.3 instead of -92.1 (and likewise for f64 below 2.2e-308).
struct Log {
  template <typename C> C operator()(C x) const { return std::log(x); }
};
// No Eigen form: with EIGEN_FAST_MATH its AVX-512 sqrt is x * rsqrt(x) refined by Newton
// steps, which gives NaN for +inf and flushes subnormal results to 0.
struct Sqrt {
  template <typename C> C operator()(C x) const { return std::sqrt(x); }
};
struct Rsqrt {
  template <typename C> C operator()(C x) const { return C(1) / std::sqrt(x); }
#if defined(__AVX512F__)
  // f32 with AVX-512 only: Eigen's f64 rsqrt, and its AVX2 f32 rsqrt (--config=portable),
  // return inf for subnormal inputs.
  template <typename A>
    requires std::is_same_v<typename A::Scalar, float>
  auto eigen(const A& a) const { return a.rsqrt(); }
#endif
};
struct Tanh {
  template <typename C> C operator()(C x) const { return std::tanh(x); }
  template <typename A> auto eigen(const A& a) const { return a.tanh(); }
};
struct Sigmoid {
  template <typename C> C operator()(C x) const { return C(1) / (C(1) + std::exp(-x)); }
  // Not Eigen's logistic(): its float version is accurate only in absolute terms, so small
  // outputs (x < -7) lost most of their relative precision. exp() keeps it relative; f32
  // only, as Exp (Eigen's f64 exp saturates instead of overflowing: sigmoid(-800) != 0).
  template <typename A>
    requires std::is_same_v<typename A::Scalar, float>
  auto eigen(const A& a) const {
    using S = typename A::Scalar;
    return (S(1) + (-a).exp()).inverse();
  }
};
struct GeluExact {
  template <typename C> C operator()(C x) const {
    return C(0.5) * x * (C(1) + std::erf(x * C(kSqrt1_2)));
  }
  template <typename A> auto eigen(const A& a) const {
    using S = typename A::Scalar;
    return S(0.5) * a * (S(1) + (a * S(kSqrt1_2)).erf());
  }
};
struct GeluTanh {
  template <typename C> C operator()(C x) const {
    return C(0.5) * x * (C(1) + std::tanh(C(kSqrt2OverPi) * (x + C(kGeluCoeff) * x * x * x)));
  }
  template <typename A> auto eigen(const A& a) const {
    using S = typename A::Scalar;
    return S(0.5) * a * (S(1) + (S(kSqrt2OverPi) * (a + S(kGeluCoeff) * a.cube())).tanh());
  }
};

template <typename F, typename A>
concept HasEigen = requires(const F& f, const A& a) { f.eigen(a); };

template <typename T, typename F>
void unary_loop(const Tensor& in, const Tensor& out, F f) {
  using C = compute_t<T>;
  for_each_run(operands_for<2>(out, {in}), [&](const Run<2>& r) {
    T* o = reinterpret_cast<T*>(r.ptr[0]);
    const T* a = reinterpret_cast<const T*>(r.ptr[1]);
    constexpr int64_t s = sizeof(T);
    if (r.stride[0] == s && r.stride[1] == s) {
      using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
      if constexpr (std::is_floating_point_v<T>) {
        if constexpr (HasEigen<F, Eigen::Map<const Arr>>) {
          Eigen::Map<Arr>(o, r.n) = f.eigen(Eigen::Map<const Arr>(a, r.n));
          return;
        }
      }
      for (int64_t i = 0; i < r.n; ++i) o[i] = T(f(C(a[i])));
    } else {
      const int64_t so = r.stride[0] / s, sa = r.stride[1] / s;
      for (int64_t i = 0; i < r.n; ++i) o[i * so] = T(f(C(a[i * sa])));
    }
  });
}

template <typename F>
KernelFn unary_kernel() {
  return [](std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
    visit_dtype(in[0].dtype(), [&]<typename T>() {
      if constexpr (!std::is_same_v<T, bool>) unary_loop<T>(in[0], out[0], F{});
    });
  };
}

void gelu_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  visit_float_dtype(in[0].dtype(), "gelu", [&]<typename T>() {
    if (attrs.approximate_tanh) unary_loop<T>(in[0], out[0], GeluTanh{});
    else unary_loop<T>(in[0], out[0], GeluExact{});
  });
}

// ---- binary ------------------------------------------------------------------------------

struct Add { template <typename C> C operator()(C a, C b) const { return a + b; } };
struct Sub { template <typename C> C operator()(C a, C b) const { return a - b; } };
struct Mul { template <typename C> C operator()(C a, C b) const { return a * b; } };
struct Div { template <typename C> C operator()(C a, C b) const { return a / b; } };
struct Pow {
  template <typename C> C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      if (b < 0) fail("pow: integers to negative integer powers are not allowed ({} ** {})", a, b);
      C r = 1;
      for (C e = b, base = a; e > 0; e >>= 1, base *= base) {
        if (e & 1) r *= base;
      }
      return r;
    } else {
      return std::pow(a, b);
    }
  }
};
// NaN propagates, as in PyTorch's maximum/minimum.
struct Maximum {
  template <typename C> C operator()(C a, C b) const {
    if constexpr (std::is_floating_point_v<C>) { if (a != a || b != b) return a + b; }
    return a > b ? a : b;
  }
};
struct Minimum {
  template <typename C> C operator()(C a, C b) const {
    if constexpr (std::is_floating_point_v<C>) { if (a != a || b != b) return a + b; }
    return a < b ? a : b;
  }
};
struct Eq { template <typename C> bool operator()(C a, C b) const { return a == b; } };
struct Ne { template <typename C> bool operator()(C a, C b) const { return a != b; } };
struct Lt { template <typename C> bool operator()(C a, C b) const { return a < b; } };
struct Le { template <typename C> bool operator()(C a, C b) const { return a <= b; } };
struct Gt { template <typename C> bool operator()(C a, C b) const { return a > b; } };
struct Ge { template <typename C> bool operator()(C a, C b) const { return a >= b; } };

// out[i] = f(a[i], b[i]); Out is T for arithmetic, bool for comparisons.
template <typename T, typename Out, typename F>
void binary_loop(const Tensor& a, const Tensor& b, const Tensor& out, F f) {
  using C = compute_t<T>;
  for_each_run(operands_for<3>(out, {a, b}), [&](const Run<3>& r) {
    Out* o = reinterpret_cast<Out*>(r.ptr[0]);
    const T* x = reinterpret_cast<const T*>(r.ptr[1]);
    const T* y = reinterpret_cast<const T*>(r.ptr[2]);
    constexpr int64_t s = sizeof(T);
    // The three shapes that matter for speed get their own loops: both contiguous, and
    // one side a broadcast scalar (stride 0).
    if (r.stride[0] == sizeof(Out) && r.stride[1] == s && r.stride[2] == s) {
      for (int64_t i = 0; i < r.n; ++i) o[i] = Out(f(C(x[i]), C(y[i])));
    } else if (r.stride[0] == sizeof(Out) && r.stride[1] == s && r.stride[2] == 0) {
      const C yv = C(y[0]);
      for (int64_t i = 0; i < r.n; ++i) o[i] = Out(f(C(x[i]), yv));
    } else if (r.stride[0] == sizeof(Out) && r.stride[1] == 0 && r.stride[2] == s) {
      const C xv = C(x[0]);
      for (int64_t i = 0; i < r.n; ++i) o[i] = Out(f(xv, C(y[i])));
    } else {
      const int64_t so = r.stride[0] / int64_t(sizeof(Out)), sx = r.stride[1] / s,
                    sy = r.stride[2] / s;
      for (int64_t i = 0; i < r.n; ++i) o[i * so] = Out(f(C(x[i * sx]), C(y[i * sy])));
    }
  });
}

template <typename F>
KernelFn binary_kernel() {
  return [](std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
    visit_dtype(in[0].dtype(), [&]<typename T>() {
      if constexpr (!std::is_same_v<T, bool>) binary_loop<T, T>(in[0], in[1], out[0], F{});
    });
  };
}

template <typename F>
KernelFn compare_kernel() {
  return [](std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
    visit_dtype(in[0].dtype(), [&]<typename T>() {
      binary_loop<T, bool>(in[0], in[1], out[0], F{});
    });
  };
}

void where_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  visit_dtype(in[1].dtype(), [&]<typename T>() {
    for_each_run(operands_for<4>(out[0], {in[0], in[1], in[2]}), [&](const Run<4>& r) {
      T* o = reinterpret_cast<T*>(r.ptr[0]);
      const bool* c = reinterpret_cast<const bool*>(r.ptr[1]);
      const T* a = reinterpret_cast<const T*>(r.ptr[2]);
      const T* b = reinterpret_cast<const T*>(r.ptr[3]);
      const int64_t so = r.stride[0] / int64_t(sizeof(T)), sc = r.stride[1],
                    sa = r.stride[2] / int64_t(sizeof(T)), sb = r.stride[3] / int64_t(sizeof(T));
      for (int64_t i = 0; i < r.n; ++i) o[i * so] = c[i * sc] ? a[i * sa] : b[i * sb];
    });
  });
}

// d/dx gelu(x) * grad.
struct GeluExactGrad {
  template <typename C> C operator()(C g, C x) const {
    const C cdf = C(0.5) * (C(1) + std::erf(x * C(kSqrt1_2)));
    const C pdf = C(kInvSqrt2Pi) * std::exp(C(-0.5) * x * x);
    return g * (cdf + x * pdf);
  }
};
struct GeluTanhGrad {
  template <typename C> C operator()(C g, C x) const {
    const C x2 = x * x;
    const C t = std::tanh(C(kSqrt2OverPi) * (x + C(kGeluCoeff) * x2 * x));
    const C dt = C(kSqrt2OverPi) * (C(1) + C(3 * kGeluCoeff) * x2) * (C(1) - t * t);
    return g * (C(0.5) * (C(1) + t) + C(0.5) * x * dt);
  }
};

void gelu_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  visit_float_dtype(in[1].dtype(), "gelu_backward", [&]<typename T>() {
    if (attrs.approximate_tanh) binary_loop<T, T>(in[0], in[1], out[0], GeluTanhGrad{});
    else binary_loop<T, T>(in[0], in[1], out[0], GeluExactGrad{});
  });
}

TS_REGISTER_KERNEL(cpu, neg, unary_kernel<Neg>());
TS_REGISTER_KERNEL(cpu, exp, unary_kernel<Exp>());
TS_REGISTER_KERNEL(cpu, log, unary_kernel<Log>());
TS_REGISTER_KERNEL(cpu, sqrt, unary_kernel<Sqrt>());
TS_REGISTER_KERNEL(cpu, rsqrt, unary_kernel<Rsqrt>());
TS_REGISTER_KERNEL(cpu, abs, unary_kernel<Abs>());
TS_REGISTER_KERNEL(cpu, tanh, unary_kernel<Tanh>());
TS_REGISTER_KERNEL(cpu, sigmoid, unary_kernel<Sigmoid>());
TS_REGISTER_KERNEL(cpu, relu, unary_kernel<Relu>());
TS_REGISTER_KERNEL(cpu, gelu, gelu_kernel);
TS_REGISTER_KERNEL(cpu, gelu_backward, gelu_backward_kernel);
TS_REGISTER_KERNEL(cpu, add, binary_kernel<Add>());
TS_REGISTER_KERNEL(cpu, sub, binary_kernel<Sub>());
TS_REGISTER_KERNEL(cpu, mul, binary_kernel<Mul>());
TS_REGISTER_KERNEL(cpu, div, binary_kernel<Div>());
TS_REGISTER_KERNEL(cpu, pow, binary_kernel<Pow>());
TS_REGISTER_KERNEL(cpu, maximum, binary_kernel<Maximum>());
TS_REGISTER_KERNEL(cpu, minimum, binary_kernel<Minimum>());
TS_REGISTER_KERNEL(cpu, where, where_kernel);
TS_REGISTER_KERNEL(cpu, eq, compare_kernel<Eq>());
TS_REGISTER_KERNEL(cpu, ne, compare_kernel<Ne>());
TS_REGISTER_KERNEL(cpu, lt, compare_kernel<Lt>());
TS_REGISTER_KERNEL(cpu, le, compare_kernel<Le>());
TS_REGISTER_KERNEL(cpu, gt, compare_kernel<Gt>());
TS_REGISTER_KERNEL(cpu, ge, compare_kernel<Ge>());

}  // namespace
}  // namespace tessera::cpu
