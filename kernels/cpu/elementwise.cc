// CPU elementwise kernels: the functor families of the op list (unary, binary with
// broadcasting, comparisons), registered for every member from kernels/scalar_ops.h, plus
// gelu, gelu_backward and where. Contiguous f32/f64 runs of transcendental ops go through
// Eigen's vectorised array functions (EigenForm below); everything else is a plain loop the
// compiler vectorises on contiguous runs.
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/loops.h"
#include "kernels/cpu/util.h"
#include "kernels/scalar_ops.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

namespace ops = scalar_ops;

// ---- Eigen array forms of some functors (contiguous f32/f64 runs) --------------------------
// A functor without one runs the scalar loop. Kept only where Eigen's form is as accurate as
// the scalar one on the values the op sweep checks. Runs are evaluated with packets only
// (packet_runs below): an Eigen expression over a dynamic-size Map would take an unaligned
// head and a tail through the scalar functions, whose bits differ, so an element's value
// would depend on where its thread's chunk starts, that is on the thread count.
template <typename F> struct EigenForm;

template <> struct EigenForm<ops::exp> {
  // f32 only: Eigen 3.4's double exp clamps its argument at -709.4, so exp(-inf) and
  // exp(x < -709.4) gave 5.6e-309 instead of 0 / the true subnormal.
  template <typename A>
    requires std::is_same_v<typename A::Scalar, float>
  static auto apply(const A& a) { return a.exp(); }
};
// No form for log (Eigen 3.4's log clamps subnormal inputs to the smallest normal, so
// log(1e-40f) gave -87.3 instead of -92.1) nor sqrt (with EIGEN_FAST_MATH its AVX-512 sqrt
// is x * rsqrt(x) refined by Newton steps: NaN for +inf, subnormal results flushed to 0).
#if defined(__AVX512F__)
template <> struct EigenForm<ops::rsqrt> {
  // f32 with AVX-512 only: Eigen's f64 rsqrt, and its AVX2 f32 rsqrt (--config=portable),
  // return inf for subnormal inputs.
  template <typename A>
    requires std::is_same_v<typename A::Scalar, float>
  static auto apply(const A& a) { return a.rsqrt(); }
};
#endif
template <> struct EigenForm<ops::tanh> {
  template <typename A> static auto apply(const A& a) { return a.tanh(); }
};
template <> struct EigenForm<ops::sigmoid> {
  // Not Eigen's logistic(): its float version is accurate only in absolute terms. f32 only,
  // as exp.
  template <typename A>
    requires std::is_same_v<typename A::Scalar, float>
  static auto apply(const A& a) {
    using S = typename A::Scalar;
    return (S(1) + (-a).exp()).inverse();
  }
};
template <> struct EigenForm<ops::gelu_erf> {
  template <typename A> static auto apply(const A& a) {
    using S = typename A::Scalar;
    return S(0.5) * a * (S(1) + (a * S(ops::kSqrt1_2)).erf());
  }
};
template <> struct EigenForm<ops::gelu_tanh> {
  template <typename A> static auto apply(const A& a) {
    using S = typename A::Scalar;
    return S(0.5) * a *
           (S(1) + (S(ops::kSqrt2OverPi) * (a + S(ops::kGeluCoeff) * a.cube())).tanh());
  }
};

template <typename F, typename A>
concept HasEigen = requires(const A& a) { EigenForm<F>::apply(a); };

// The same for binary functors, f32 only: apply(a, b, out) writes f(a, b) over a block whose
// length is a multiple of kPacket and whose output is 64-byte aligned, so Eigen evaluates it
// with packets only. A run's unaligned head and its tail (under kPacket elements each) go
// through a zero-padded aligned packet-sized buffer instead of Eigen's scalar functions,
// whose bits differ: every element takes the same vectorised path wherever a thread's chunk
// starts, so results do not depend on the thread count. gelu's backward is the case that
// matters: a scalar tanh per element made it 60x slower than its forward.
constexpr int64_t kEigenBlock = 256;
constexpr int64_t kPacket = 16;  // a multiple of every float packet width (AVX-512: 16)
using OutMap = Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64>;
using InMap = Eigen::Map<const Eigen::ArrayXf>;
using Temp = Eigen::Array<float, Eigen::Dynamic, 1, 0, kEigenBlock, 1>;
template <typename F> struct EigenForm2;

template <> struct EigenForm2<ops::gelu_tanh_backward> {
  // Eigen's tanh is a rational approximation within an ulp or two of libm's; where u < -2,
  // 1 + t cancels (t near -1) and those ulps become whole percents of the result, so there
  // the functor itself runs, as on the scalar path and on CUDA (kernels/scalar_ops.h).
  static void apply(const InMap& g, const InMap& x, OutMap& out) {
    const Temp x2 = x.square();
    const Temp u = float(ops::kSqrt2OverPi) * (x + float(ops::kGeluCoeff) * x2 * x);
    const Temp t = u.tanh();
    out = g * (0.5f * (1.0f + t) +
               0.5f * x * (float(ops::kSqrt2OverPi) * (1.0f + float(3 * ops::kGeluCoeff) * x2) * (1.0f - t.square())));
    // Such lanes are few (x < -2.09: 1.8% of a standard normal's, in a quarter of its
    // 16-lane packets): a vectorised minimum finds the packets holding one (and skips the
    // block when none does), and only those are walked element by element. A branch per
    // element was half of this function's time, and a scalar count per packet a third. The
    // minimum propagates NaN: Eigen's default may let a NaN lane swallow a lower one, which
    // would skip that lane; a NaN minimum walks the packet, where a NaN lane is not below.
    if (u.minCoeff<Eigen::PropagateNaN>() >= -2.0f) return;
    for (Eigen::Index i0 = 0; i0 < out.size(); i0 += kPacket) {
      const auto packet = u.template segment<kPacket>(i0);
      if (packet.template minCoeff<Eigen::PropagateNaN>() >= -2.0f) continue;
      for (Eigen::Index i = i0; i < i0 + kPacket; ++i) {
        if (u[i] < -2.0f) out[i] = ops::gelu_tanh_backward{}(g[i], x[i]);
      }
    }
  }
};
template <> struct EigenForm2<ops::gelu_erf_backward> {
  static void apply(const InMap& g, const InMap& x, OutMap& out) {
    out = g * (0.5f * (1.0f + (x * float(ops::kSqrt1_2)).erf()) +
               x * (float(ops::kInvSqrt2Pi) * (-0.5f * x.square()).exp()));
  }
};

// Cuts [0, n) of `out` into an unaligned head, a body and a tail: bulk(i, m) evaluates
// [i, i + m) with out + i 64-byte aligned and m a multiple of kPacket (at most kEigenBlock),
// padded(i, m) evaluates m < kPacket elements through an aligned packet-sized buffer.
template <typename T, typename Bulk, typename Padded>
void packet_runs(T* out, int64_t n, Bulk&& bulk, Padded&& padded) {
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % 64);
  if (misaligned % static_cast<int64_t>(sizeof(T)) != 0) {  // never aligned: all padded
    for (int64_t i = 0; i < n; i += kPacket) padded(i, std::min(kPacket, n - i));
    return;
  }
  int64_t i = std::min(n, (64 - misaligned) % 64 / static_cast<int64_t>(sizeof(T)));
  if (i > 0) padded(int64_t{0}, i);
  while (n - i >= kPacket) {
    const int64_t m = std::min(kEigenBlock, (n - i) / kPacket * kPacket);
    bulk(i, m);
    i += m;
  }
  if (i < n) padded(i, n - i);
}

// out[i] = f(a[i], b[i]) for i < n through EigenForm2<F> (see above).
template <typename F>
void eigen_binary(const float* a, const float* b, float* out, int64_t n) {
  packet_runs(
      out, n,
      [&](int64_t i, int64_t m) {
        OutMap om(out + i, m);
        EigenForm2<F>::apply(InMap(a + i, m), InMap(b + i, m), om);
      },
      [&](int64_t i, int64_t m) {
        alignas(64) float as[kPacket] = {}, bs[kPacket] = {}, os[kPacket];
        std::copy(a + i, a + i + m, as);
        std::copy(b + i, b + i + m, bs);
        OutMap om(os, kPacket);
        EigenForm2<F>::apply(InMap(as, kPacket), InMap(bs, kPacket), om);
        std::copy(os, os + m, out + i);
      });
}

// out[i] = f(a[i]) for i < n through EigenForm<F>, on the same packet-only path.
template <typename F, typename T>
void eigen_unary(const T* a, T* out, int64_t n) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  using Out = Eigen::Map<Arr, Eigen::Aligned64>;
  using In = Eigen::Map<const Arr>;
  packet_runs(
      out, n, [&](int64_t i, int64_t m) { Out(out + i, m) = EigenForm<F>::apply(In(a + i, m)); },
      [&](int64_t i, int64_t m) {
        alignas(64) T as[kPacket] = {}, os[kPacket];
        std::copy(a + i, a + i + m, as);
        Out(os, kPacket) = EigenForm<F>::apply(In(as, kPacket));
        std::copy(os, os + m, out + i);
      });
}

template <typename F>
concept HasEigen2 = requires(const InMap& a, OutMap& o) { EigenForm2<F>::apply(a, a, o); };

// f over a contiguous f32/f64 run as the op kernels evaluate it: Eigen's form where the
// functor has one (above), else the scalar functor. The functor ops' contiguous runs and
// linear's epilogue (activation_run) both come here, so they give the same bits.
template <typename T, typename F>
void contiguous_unary(const T* x, T* y, int64_t n, F f) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  if constexpr (HasEigen<F, Eigen::Map<const Arr>>) {
    eigen_unary<F>(x, y, n);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
  }
}
template <typename T, typename F>
void contiguous_binary(const T* a, const T* b, T* out, int64_t n, F f) {
  if constexpr (std::is_same_v<T, float> && HasEigen2<F>) {
    eigen_binary<F>(a, b, out, n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
  }
}

// f16/bf16 contiguous runs: a block at a time widened (kernels/cpu/copy.cc's run helpers, F16C
// for f16), evaluated as an f32 run (Eigen's vectorised form where the functor has one, else
// a plain loop the compiler vectorises) and rounded once, so an element's bits are the f32
// op's result rounded, wherever its thread's run starts. Element by element (a conversion,
// the scalar functor, a rounding), gelu on bf16 cost ~14 ns an element and GPT-mini's bf16 MLP
// spent ~34% of its step there (BENCHMARKS.md, eleventh CPU section).
template <typename F>
concept FloatToFloat = std::is_same_v<std::invoke_result_t<F, float>, float>;
template <typename F>
concept FloatsToFloat = std::is_same_v<std::invoke_result_t<F, float, float>, float>;

template <typename T, typename F>
void widened_unary(const T* x, T* y, int64_t n, F f) {
  alignas(64) float buf[kEigenBlock];
  for (int64_t i = 0; i < n; i += kEigenBlock) {
    const int64_t m = std::min(kEigenBlock, n - i);
    widen_run(x + i, buf, m);
    contiguous_unary(buf, buf, m, f);
    narrow_run(buf, y + i, m);
  }
}
template <typename T, typename F>
void widened_binary(const T* a, const T* b, T* out, int64_t n, F f) {
  alignas(64) float wa[kEigenBlock], wb[kEigenBlock], wo[kEigenBlock];
  for (int64_t i = 0; i < n; i += kEigenBlock) {
    const int64_t m = std::min(kEigenBlock, n - i);
    widen_run(a + i, wa, m);
    widen_run(b + i, wb, m);
    contiguous_binary(wa, wb, wo, m, f);  // (gelu's backward reads its inputs after writing)
    narrow_run(wo, out + i, m);
  }
}

template <typename T, typename F>
void unary_loop(const Tensor& in, const Tensor& out, F f) {
  using C = compute_t<T>;
  for_each_run(operands_for<2>(out, {in}), [&](const Run<2>& r) {
    T* o = reinterpret_cast<T*>(r.ptr[0]);
    const T* a = reinterpret_cast<const T*>(r.ptr[1]);
    constexpr int64_t s = sizeof(T);
    if (r.stride[0] == s && r.stride[1] == s) {
      if constexpr (std::is_floating_point_v<T>) {
        contiguous_unary(a, o, r.n, f);
        return;
      } else if constexpr (is_low_precision_v<T> && FloatToFloat<F>) {
        widened_unary(a, o, r.n, f);
        return;
      }
      for (int64_t i = 0; i < r.n; ++i) o[i] = T(f(C(a[i])));
    } else {
      const int64_t so = r.stride[0] / s, sa = r.stride[1] / s;
      for (int64_t i = 0; i < r.n; ++i) o[i * so] = T(f(C(a[i * sa])));
    }
  });
}

// The dtypes a family's kernel is instantiated for: floats only for UnaryFloat and
// BinaryFloat (shape inference rejects the rest), every numeric dtype otherwise.
template <typename T, bool floats_only>
constexpr bool runs_on = std::is_floating_point_v<compute_t<T>> ||
                         (!floats_only && !std::is_same_v<T, bool>);

template <typename F, bool floats_only>
void unary_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  visit_dtype(in[0].dtype(), [&]<typename T>() {
    if constexpr (runs_on<T, floats_only>) {
      unary_loop<T>(in[0], out[0], F{});
    }
  });
}

void gelu_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  visit_float_dtype(in[0].dtype(), "gelu", [&]<typename T>() {
    if (attrs.approximate_tanh) unary_loop<T>(in[0], out[0], ops::gelu_tanh{});
    else unary_loop<T>(in[0], out[0], ops::gelu_erf{});
  });
}

// ---- binary ------------------------------------------------------------------------------

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
      if constexpr (std::is_floating_point_v<T> && std::is_same_v<Out, T>) {
        contiguous_binary(x, y, o, r.n, f);
        return;
      } else if constexpr (is_low_precision_v<T> && std::is_same_v<Out, T> && FloatsToFloat<F>) {
        widened_binary(x, y, o, r.n, f);
        return;
      }
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

template <typename F, bool floats_only>
void binary_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  visit_dtype(in[0].dtype(), [&]<typename T>() {
    if constexpr (runs_on<T, floats_only>) {
      binary_loop<T, T>(in[0], in[1], out[0], F{});
    }
  });
}

template <typename F>
void compare_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  visit_dtype(in[0].dtype(), [&]<typename T>() {
    binary_loop<T, bool>(in[0], in[1], out[0], F{});
  });
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

void gelu_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  visit_float_dtype(in[1].dtype(), "gelu_backward", [&]<typename T>() {
    if (attrs.approximate_tanh) binary_loop<T, T>(in[0], in[1], out[0], ops::gelu_tanh_backward{});
    else binary_loop<T, T>(in[0], in[1], out[0], ops::gelu_erf_backward{});
  });
}

// Calls f with the functor of act's forward (relu, gelu_erf, gelu_tanh); none is the
// caller's (kernels/cpu/activation.h).
template <typename F>
void with_activation(Activation act, F&& f) {
  switch (act) {
    case Activation::none: return;
    case Activation::relu: return f(ops::relu{});
    case Activation::gelu: return f(ops::gelu_erf{});
    case Activation::gelu_tanh: return f(ops::gelu_tanh{});
  }
}

template <typename T>
void activation_run_typed(Activation act, const T* x, T* y, int64_t n) {
  if (act == Activation::none && x != y) std::copy(x, x + n, y);
  with_activation(act, [&](auto f) { contiguous_unary(x, y, n, f); });
}

template <typename T>
void activation_backward_typed(Activation act, const T* g, const T* x, T* out, int64_t n) {
  switch (act) {
    case Activation::none:
      if (g != out) std::copy(g, g + n, out);
      return;
    case Activation::relu:
      for (int64_t i = 0; i < n; ++i) out[i] = x[i] > T(0) ? g[i] : T(0);
      return;
    case Activation::gelu: return contiguous_binary(g, x, out, n, ops::gelu_erf_backward{});
    case Activation::gelu_tanh: return contiguous_binary(g, x, out, n, ops::gelu_tanh_backward{});
  }
}

// Every functor family op, from the op list: the functor of the same name.
constexpr bool kFloatsOnly_UnaryFloat = true, kFloatsOnly_UnaryNumeric = false,
               kFloatsOnly_Binary = false, kFloatsOnly_BinaryFloat = true;
#define TS_CPU_UNARY(_, name, family, props) \
  register_kernel(DeviceType::cpu, OpId::name, &unary_kernel<ops::name, kFloatsOnly_##family>);
#define TS_CPU_BINARY(_, name, family, props) \
  register_kernel(DeviceType::cpu, OpId::name, &binary_kernel<ops::name, kFloatsOnly_##family>);
#define TS_CPU_COMPARE(_, name, family, props) \
  register_kernel(DeviceType::cpu, OpId::name, &compare_kernel<ops::name>);
const bool kFamiliesRegistered = [] {
  TS_UNARY_OPS(TS_CPU_UNARY, _)
  TS_BINARY_OPS(TS_CPU_BINARY, _)
  TS_COMPARE_OPS(TS_CPU_COMPARE, _)
  return true;
}();
#undef TS_CPU_UNARY
#undef TS_CPU_BINARY
#undef TS_CPU_COMPARE

TS_REGISTER_KERNEL(cpu, gelu, gelu_kernel);
TS_REGISTER_KERNEL(cpu, gelu_backward, gelu_backward_kernel);
TS_REGISTER_KERNEL(cpu, where, where_kernel);

}  // namespace
void activation_run(Activation act, const float* x, float* y, int64_t n) {
  activation_run_typed(act, x, y, n);
}
void activation_run(Activation act, const double* x, double* y, int64_t n) {
  activation_run_typed(act, x, y, n);
}
void activation_backward_run(Activation act, const float* g, const float* x, float* out, int64_t n) {
  activation_backward_typed(act, g, x, out, n);
}
void activation_backward_run(Activation act, const double* g, const double* x, double* out, int64_t n) {
  activation_backward_typed(act, g, x, out, n);
}

}  // namespace tessera::cpu
