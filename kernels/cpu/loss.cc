// CPU cross_entropy: fused log-softmax + NLL over logits [N, C], with ignore_index and
// mean/sum/none reductions; 16-bit logits are read as they are and the loss (and its
// gradient coming back) is f32. The forward saves each row's logsumexp for the backward,
// which writes (softmax - onehot) * scale without materialising the softmax separately.
// f32 and 16-bit logits take their exps over packets (vec_math.h), f64 through libm.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "kernels/cpu/vec_math.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

int64_t load_index(const Tensor& t, int64_t i) {
  return t.dtype() == DType::i64 ? static_cast<const int64_t*>(t.raw_data())[i]
                                 : static_cast<const int32_t*>(t.raw_data())[i];
}

void check_target(const char* op, int64_t target, int64_t row, int64_t classes,
                  int64_t ignore_index) {
  if (target != ignore_index && (target < 0 || target >= classes)) {
    fail("{}: target {} at row {} is out of range for {} classes (ignore_index {})", op, target,
         row, classes, ignore_index);
  }
}

// Logits a chunk at a time through f32 (exp_affine's input): f32 rows as they are, 16-bit
// ones (kWidened) widened into `buf`.
constexpr int64_t kChunk = 1024;
template <typename T>
constexpr bool kWidened = std::is_same_v<compute_t<T>, float> && !std::is_same_v<T, float>;
template <typename T>
const float* as_f32(const T* x, int64_t m, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    widen_run(x, buf.data(), m);
    return buf.data();
  }
}

template <typename T>
void ce_forward(const Tensor& logits_in, const Tensor& target_in, const Tensor& loss,
                const Tensor& lse_out, const Attrs& a) {
  using C = compute_t<T>;
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Tensor logits = contiguous_cpu(logits_in);
  const Tensor target = contiguous_cpu(target_in);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const T* xp = static_cast<const T*>(logits.raw_data());
  S* lse = static_cast<S*>(lse_out.raw_data());
  std::vector<double> row_loss(n, 0.0);
  parallel_for(0, n, std::max<int64_t>(1, kElementwiseGrain / c), [&](int64_t b, int64_t e) {
    // The widened logits (16-bit rows) and then, in place, their exps.
    std::vector<float> chunk(std::is_same_v<C, float> ? std::min(kChunk, c) : 0);
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = load_index(target, r);
      check_target("cross_entropy", t, r, c, a.ignore_index);
      const T* xr = xp + r * c;
      C mx = -std::numeric_limits<C>::infinity();
      for (int64_t i = 0; i < c; ++i) mx = std::max<C>(mx, C(xr[i]));
      double s = 0;
      if constexpr (std::is_same_v<C, float>) {
        // exp over packets (vec_math.h), a chunk at a time: each chunk's sum in f32 lanes,
        // the chunks' in f64.
        for (int64_t i = 0; i < c; i += kChunk) {
          const int64_t m = std::min(kChunk, c - i);
          s += exp_affine(as_f32(xr + i, m, chunk), chunk.data(), m, 1.0f, mx);
        }
      } else {
        for (int64_t i = 0; i < c; ++i) s += std::exp(static_cast<double>(C(xr[i]) - mx));
      }
      const double l = static_cast<double>(mx) + std::log(s);
      lse[r] = static_cast<S>(l);
      row_loss[r] = t == a.ignore_index ? 0.0 : l - static_cast<double>(C(xr[t]));
    }
  });
  S* out = static_cast<S*>(loss.raw_data());  // the loss in the stats dtype
  if (a.reduction == Reduction::none) {
    for (int64_t r = 0; r < n; ++r) out[r] = static_cast<S>(row_loss[r]);
    return;
  }
  double total = 0;
  int64_t count = 0;
  for (int64_t r = 0; r < n; ++r) {
    total += row_loss[r];
    count += load_index(target, r) != a.ignore_index;
  }
  // Mean over no counted targets is 0/0 = NaN, as in PyTorch.
  const double v = a.reduction == Reduction::sum ? total : total / static_cast<double>(count);
  out[0] = static_cast<S>(v);
}

void cross_entropy_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_float_dtype(in[0].dtype(), "cross_entropy", [&]<typename T>() {
    ce_forward<T>(in[0], in[1], out[0], out[1], a);
  });
}

// Inputs: grad, logits, target, logsumexp.
template <typename T>
void ce_backward(std::span<const Tensor> in, const Tensor& dx, const Attrs& a) {
  using C = compute_t<T>;
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Tensor g = contiguous_cpu(in[0]);
  const Tensor logits = contiguous_cpu(in[1]);
  const Tensor target = contiguous_cpu(in[2]);
  const Tensor lse_t = contiguous_cpu(in[3]);
  const int64_t n = logits.shape()[0], c = logits.shape()[1];
  const T* xp = static_cast<const T*>(logits.raw_data());
  const S* gp = static_cast<const S*>(g.raw_data());  // the loss's dtype
  const S* lse = static_cast<const S*>(lse_t.raw_data());
  T* dp = static_cast<T*>(dx.raw_data());
  double scale = 1.0;
  if (a.reduction != Reduction::none) {
    scale = static_cast<double>(gp[0]);
    if (a.reduction == Reduction::mean) {
      int64_t count = 0;
      for (int64_t r = 0; r < n; ++r) count += load_index(target, r) != a.ignore_index;
      scale /= static_cast<double>(count);
    }
  }
  parallel_for(0, n, std::max<int64_t>(1, kElementwiseGrain / c), [&](int64_t b, int64_t e) {
    std::vector<float> chunk(kWidened<T> ? std::min(kChunk, c) : 0);
    std::vector<float> probs(std::is_same_v<C, float> ? std::min(kChunk, c) : 0);
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = load_index(target, r);
      check_target("cross_entropy_backward", t, r, c, a.ignore_index);
      T* dr = dp + r * c;
      if (t == a.ignore_index) {
        std::fill(dr, dr + c, T(0.0f));
        continue;
      }
      const C s = static_cast<C>(a.reduction == Reduction::none ? static_cast<double>(gp[r]) : scale);
      const C l = static_cast<C>(lse[r]);
      const T* xr = xp + r * c;
      // The target entry subtracts s before the one rounding to T: rounding p * s first
      // would lose the cancelling digits in 16-bit dtypes.
      if constexpr (std::is_same_v<C, float>) {
        for (int64_t i0 = 0; i0 < c; i0 += kChunk) {
          const int64_t m = std::min(kChunk, c - i0);
          exp_affine(as_f32(xr + i0, m, chunk), probs.data(), m, 1.0f, l);
          for (int64_t i = 0; i < m; ++i) {
            const C v = probs[i] * s;
            dr[i0 + i] = T(i0 + i == t ? v - s : v);
          }
        }
      } else {
        for (int64_t i = 0; i < c; ++i) {
          const C v = std::exp(C(xr[i]) - l) * s;
          dr[i] = T(i == t ? v - s : v);
        }
      }
    }
  });
}

void cross_entropy_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                   const Attrs& a) {
  visit_float_dtype(in[1].dtype(), "cross_entropy_backward", [&]<typename T>() {
    ce_backward<T>(in, out[0], a);
  });
}

TS_REGISTER_KERNEL(cpu, cross_entropy, cross_entropy_kernel);
TS_REGISTER_KERNEL(cpu, cross_entropy_backward, cross_entropy_backward_kernel);

}  // namespace
}  // namespace tessera::cpu
