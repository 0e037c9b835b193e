// CPU optimizer updates, fused: adamw_ and sgd_ read the gradient and write param, moments
// and the optional f32 master copy in one pass (PyTorch's single-tensor semantics, see
// tensor/ops.h). f16/bf16 params are updated in f32 (on the master when there is one) and
// written back rounded once; the moments are f32 (f64 for f64 params). Both also take the
// multi-tensor form (k tuples of inputs, see tensor/meta_optim.cc): each tuple is updated
// exactly as a single-tensor call would update it.
//
// Built with -fno-math-errno (kernels/cpu/BUILD): otherwise GCC keeps sqrt as a call that
// may set errno and does not vectorise the AdamW loop.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/update_checks.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

// An update costs ~4x a plain elementwise op per element, so chunks can be smaller.
constexpr int64_t kUpdateGrain = kElementwiseGrain / 4;

template <typename T>
T* at(char* base) {
  return reinterpret_cast<T*>(base);
}

// Element strides of a run; all 1 on the contiguous fast path (a compile-time constant
// there, so the loop vectorises).
template <int N>
bool contiguous_run(const Run<N>& r, const std::array<int64_t, N>& sizes) {
  for (int k = 0; k < N; ++k) {
    if (r.stride[k] != sizes[k]) return false;
  }
  return true;
}

// ---- AdamW ---------------------------------------------------------------------------------

template <typename C>
struct AdamConsts {
  C decay;      // 1 - lr * weight_decay
  C w1;         // 1 - beta1 (exp_avg lerps towards grad by this weight)
  C beta2, w2;  // exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2
  C bc2_sqrt;   // sqrt(1 - beta2^t)
  C eps;
  C step_size;  // lr / (1 - beta1^t)
};

// P: param/grad type; S: moment (and compute) type; master: f32 when kMaster.
template <bool kContig, bool kMaster, typename P, typename S, int N>
void adamw_run(const Run<N>& r, const AdamConsts<S>& k) {
  constexpr int64_t sp = sizeof(P), ss = sizeof(S);
  const int64_t n = r.n;
  P* __restrict p = at<P>(r.ptr[0]);
  const P* __restrict g = at<const P>(r.ptr[1]);
  S* __restrict m = at<S>(r.ptr[2]);
  S* __restrict v = at<S>(r.ptr[3]);
  float* __restrict w = nullptr;
  const int64_t s0 = kContig ? 1 : r.stride[0] / sp, s1 = kContig ? 1 : r.stride[1] / sp;
  const int64_t s2 = kContig ? 1 : r.stride[2] / ss, s3 = kContig ? 1 : r.stride[3] / ss;
  int64_t s4 = 1;
  if constexpr (kMaster) {
    w = at<float>(r.ptr[4]);
    s4 = kContig ? 1 : r.stride[4] / int64_t(sizeof(float));
  }
  for (int64_t i = 0; i < n; ++i) {
    S x;
    if constexpr (kMaster) x = w[i * s4];
    else x = S(p[i * s0]);
    const S gi = S(g[i * s1]);
    x *= k.decay;
    S mi = m[i * s2];
    mi += k.w1 * (gi - mi);
    m[i * s2] = mi;
    const S vi = v[i * s3] * k.beta2 + k.w2 * (gi * gi);
    v[i * s3] = vi;
    const S denom = std::sqrt(vi) / k.bc2_sqrt + k.eps;
    x -= k.step_size * (mi / denom);
    if constexpr (kMaster) w[i * s4] = x;
    p[i * s0] = P(x);
  }
}

template <typename P, bool kMaster>
void adamw_typed(std::span<const Tensor> in, const Attrs& a) {
  using S = std::conditional_t<std::is_same_v<P, double>, double, float>;
  const double t = static_cast<double>(a.step_count);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
  const AdamConsts<S> k{S(1.0 - a.lr * a.weight_decay), S(1.0 - a.beta1), S(a.beta2),
                        S(1.0 - a.beta2), S(std::sqrt(bc2)), S(a.eps), S(a.lr / bc1)};
  constexpr int N = kMaster ? 5 : 4;
  std::array<int64_t, N> sizes;
  sizes.fill(int64_t(sizeof(S)));
  sizes[0] = sizes[1] = int64_t(sizeof(P));
  Operands<N> ops;
  if constexpr (kMaster) {
    sizes[4] = int64_t(sizeof(float));
    ops = operands_for<N>(in[0], {in[1], in[2], in[3], in[4]});
  } else {
    ops = operands_for<N>(in[0], {in[1], in[2], in[3]});
  }
  for_each_run(
      ops,
      [&](const Run<N>& r) {
        if (contiguous_run<N>(r, sizes)) adamw_run<true, kMaster, P, S>(r, k);
        else adamw_run<false, kMaster, P, S>(r, k);
      },
      kUpdateGrain);
}

void adamw_one(std::span<const Tensor> in, const Attrs& a) {
  const bool master = in.size() > 4 && in[4].defined();
  visit_float_dtype(in[0].dtype(), "adamw_", [&]<typename P>() {
    if constexpr (std::is_same_v<P, double>) {
      adamw_typed<P, false>(in, a);  // the meta function rejects an f64 param's master
    } else {
      if (master) adamw_typed<P, true>(in, a);
      else adamw_typed<P, false>(in, a);
    }
  });
}

void adamw_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 5);
  const size_t count = in.size() < 10 ? 0 : tuples.size();  // 0: the single-tensor form
  // Every tuple is checked before any is written: an error leaves all of them untouched.
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("adamw_", j, count, tuples[j],
                     {"param", "grad", "exp_avg", "exp_avg_sq", "master"});
  }
  for (std::span<const Tensor> t : tuples) adamw_one(t, a);
}

// ---- SGD -----------------------------------------------------------------------------------

template <typename C>
struct SgdConsts {
  C lr, weight_decay, momentum, one_minus_dampening;
  bool decay, nesterov, first;
};

template <bool kContig, bool kBuffer, bool kMaster, typename P, typename S, int N>
void sgd_run(const Run<N>& r, const SgdConsts<S>& k) {
  constexpr int64_t sp = sizeof(P), ss = sizeof(S);
  constexpr int kMasterOperand = kBuffer ? 3 : 2;
  const int64_t n = r.n;
  P* __restrict p = at<P>(r.ptr[0]);
  const P* __restrict g = at<const P>(r.ptr[1]);
  S* __restrict b = nullptr;
  float* __restrict w = nullptr;
  const int64_t s0 = kContig ? 1 : r.stride[0] / sp, s1 = kContig ? 1 : r.stride[1] / sp;
  int64_t sb = 1, sw = 1;
  if constexpr (kBuffer) {
    b = at<S>(r.ptr[2]);
    sb = kContig ? 1 : r.stride[2] / ss;
  }
  if constexpr (kMaster) {
    w = at<float>(r.ptr[kMasterOperand]);
    sw = kContig ? 1 : r.stride[kMasterOperand] / int64_t(sizeof(float));
  }
  // The flags are the same for every element; GCC unswitches the loop on them.
  for (int64_t i = 0; i < n; ++i) {
    S x;
    if constexpr (kMaster) x = w[i * sw];
    else x = S(p[i * s0]);
    S d = S(g[i * s1]);
    // Skipped, not multiplied by 0, when weight_decay == 0: 0 * inf would be NaN.
    if (k.decay) d += k.weight_decay * x;
    if constexpr (kBuffer) {
      const S bi = k.first ? d : b[i * sb] * k.momentum + k.one_minus_dampening * d;
      b[i * sb] = bi;
      d = k.nesterov ? d + k.momentum * bi : bi;
    }
    x -= k.lr * d;
    if constexpr (kMaster) w[i * sw] = x;
    p[i * s0] = P(x);
  }
}

template <typename P, bool kBuffer, bool kMaster>
void sgd_typed(std::span<const Tensor> in, const Attrs& a) {
  using S = std::conditional_t<std::is_same_v<P, double>, double, float>;
  const SgdConsts<S> k{S(a.lr),       S(a.weight_decay),  S(a.momentum), S(1.0 - a.dampening),
                       a.weight_decay != 0.0, a.nesterov, a.step_count == 1};
  constexpr int N = 2 + (kBuffer ? 1 : 0) + (kMaster ? 1 : 0);
  std::array<int64_t, N> sizes;
  sizes.fill(int64_t(sizeof(P)));
  Operands<N> ops;
  if constexpr (kBuffer && kMaster) {
    sizes[2] = int64_t(sizeof(S));
    sizes[3] = int64_t(sizeof(float));
    ops = operands_for<N>(in[0], {in[1], in[2], in[3]});
  } else if constexpr (kBuffer) {
    sizes[2] = int64_t(sizeof(S));
    ops = operands_for<N>(in[0], {in[1], in[2]});
  } else if constexpr (kMaster) {
    sizes[2] = int64_t(sizeof(float));
    ops = operands_for<N>(in[0], {in[1], in[3]});
  } else {
    ops = operands_for<N>(in[0], {in[1]});
  }
  for_each_run(
      ops,
      [&](const Run<N>& r) {
        if (contiguous_run<N>(r, sizes)) sgd_run<true, kBuffer, kMaster, P, S>(r, k);
        else sgd_run<false, kBuffer, kMaster, P, S>(r, k);
      },
      kUpdateGrain);
}

void sgd_one(std::span<const Tensor> in, const Attrs& a) {
  const bool buffer = in[2].defined();
  const bool master = in.size() > 3 && in[3].defined();
  visit_float_dtype(in[0].dtype(), "sgd_", [&]<typename P>() {
    auto with_master = [&]<bool kMaster>() {
      if (buffer) sgd_typed<P, true, kMaster>(in, a);
      else sgd_typed<P, false, kMaster>(in, a);
    };
    if constexpr (std::is_same_v<P, double>) {
      with_master.template operator()<false>();
    } else {
      if (master) with_master.template operator()<true>();
      else with_master.template operator()<false>();
    }
  });
}

void sgd_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 4);
  const size_t count = in.size() < 8 ? 0 : tuples.size();  // 0: the single-tensor form
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("sgd_", j, count, tuples[j], {"param", "grad", "momentum_buffer", "master"});
  }
  for (std::span<const Tensor> t : tuples) sgd_one(t, a);
}

TS_REGISTER_KERNEL(cpu, adamw_, adamw_kernel);
TS_REGISTER_KERNEL(cpu, sgd_, sgd_kernel);

}  // namespace
}  // namespace tessera::cpu
