// CPU attention: the spec of the fused scaled dot-product attention op (tensor/ops.h) that
// the CUDA flash-attention kernels are checked against. Plain loops per (batch, head), run in
// parallel over the B * H pairs; f64 computes in f64, the other dtypes in f32 (16-bit inputs
// widened once, results rounded once).
//
//   forward:  s_ij = scale q_i . k_j (j <= i when causal), lse_i = logsumexp_j s_ij,
//             out_i = sum_j exp(s_ij - lse_i) v_j
//   backward: P_ij = exp(s_ij - lse_i) from the saved lse, D_i = dO_i . O_i,
//             dS_ij = P_ij (dO_i . v_j - D_i); dq_i = scale sum_j dS_ij k_j,
//             dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dO_i
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

double effective_scale(const Attrs& a, int64_t head_dim) {
  return a.scale != 0.0 ? a.scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

template <typename C>
C dot(const C* a, const C* b, int64_t n) {
  C s = 0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Stores n compute-type values into `dst` (dtype T) with one rounding each.
template <typename T, typename C>
void store(T* dst, const C* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
}

template <typename T>
void attention_forward(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  using C = compute_t<T>;
  const Tensor q = to_compute_cpu(in[0]), k = to_compute_cpu(in[1]), v = to_compute_cpu(in[2]);
  const int64_t bh = q.shape()[0] * q.shape()[1], t = q.shape()[2], dh = q.shape()[3];
  const C scale = static_cast<C>(effective_scale(a, dh));
  const C* qp = static_cast<const C*>(q.raw_data());
  const C* kp = static_cast<const C*>(k.raw_data());
  const C* vp = static_cast<const C*>(v.raw_data());
  T* op = static_cast<T*>(out[0].raw_data());
  C* lp = static_cast<C*>(out[1].raw_data());  // f32, or f64 for f64
  parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<C> s(t), acc(dh);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t base = p * t * dh;
      for (int64_t i = 0; i < t; ++i) {
        const int64_t keys = a.causal ? i + 1 : t;
        const C* qi = qp + base + i * dh;
        C mx = -std::numeric_limits<C>::infinity();
        for (int64_t j = 0; j < keys; ++j) {
          s[j] = scale * dot(qi, kp + base + j * dh, dh);
          mx = std::max(mx, s[j]);
        }
        C sum = 0;
        for (int64_t j = 0; j < keys; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        std::fill(acc.begin(), acc.end(), C(0));
        for (int64_t j = 0; j < keys; ++j) {
          const C* vj = vp + base + j * dh;
          for (int64_t d = 0; d < dh; ++d) acc[d] += s[j] * vj[d];
        }
        for (int64_t d = 0; d < dh; ++d) acc[d] /= sum;
        store(op + base + i * dh, acc.data(), dh);
        lp[p * t + i] = mx + std::log(sum);
      }
    }
  });
}

void attention_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_float_dtype(in[0].dtype(), "attention",
                    [&]<typename T>() { attention_forward<T>(in, out, a); });
}

// Inputs: grad, q, k, v, out, lse. Outputs: grad_q, grad_k, grad_v.
template <typename T>
void attention_backward(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  using C = compute_t<T>;
  const Tensor g = to_compute_cpu(in[0]), q = to_compute_cpu(in[1]), k = to_compute_cpu(in[2]);
  const Tensor v = to_compute_cpu(in[3]), o = to_compute_cpu(in[4]);
  const Tensor lse = contiguous_cpu(in[5]);
  const int64_t bh = q.shape()[0] * q.shape()[1], t = q.shape()[2], dh = q.shape()[3];
  const C scale = static_cast<C>(effective_scale(a, dh));
  const C* gp = static_cast<const C*>(g.raw_data());
  const C* qp = static_cast<const C*>(q.raw_data());
  const C* kp = static_cast<const C*>(k.raw_data());
  const C* vp = static_cast<const C*>(v.raw_data());
  const C* opp = static_cast<const C*>(o.raw_data());
  const C* lp = static_cast<const C*>(lse.raw_data());
  T* dq_out = static_cast<T*>(out[0].raw_data());
  T* dk_out = static_cast<T*>(out[1].raw_data());
  T* dv_out = static_cast<T*>(out[2].raw_data());
  parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<C> prob(t), ds(t), dq(dh), dk(t * dh), dv(t * dh);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t base = p * t * dh;
      std::fill(dk.begin(), dk.end(), C(0));
      std::fill(dv.begin(), dv.end(), C(0));
      for (int64_t i = 0; i < t; ++i) {
        const int64_t keys = a.causal ? i + 1 : t;
        const C* qi = qp + base + i * dh;
        const C* gi = gp + base + i * dh;
        const C li = lp[p * t + i];
        const C di = dot(gi, opp + base + i * dh, dh);
        for (int64_t j = 0; j < keys; ++j) {
          prob[j] = std::exp(scale * dot(qi, kp + base + j * dh, dh) - li);
          ds[j] = prob[j] * (dot(gi, vp + base + j * dh, dh) - di);
        }
        std::fill(dq.begin(), dq.end(), C(0));
        for (int64_t j = 0; j < keys; ++j) {
          const C* kj = kp + base + j * dh;
          C* dkj = dk.data() + j * dh;
          C* dvj = dv.data() + j * dh;
          for (int64_t d = 0; d < dh; ++d) {
            dq[d] += ds[j] * kj[d];
            dkj[d] += ds[j] * qi[d];
            dvj[d] += prob[j] * gi[d];
          }
        }
        for (int64_t d = 0; d < dh; ++d) dq[d] *= scale;
        store(dq_out + base + i * dh, dq.data(), dh);
      }
      for (C& x : dk) x *= scale;
      store(dk_out + base, dk.data(), t * dh);
      store(dv_out + base, dv.data(), t * dh);
    }
  });
}

void attention_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                               const Attrs& a) {
  visit_float_dtype(in[1].dtype(), "attention_backward",
                    [&]<typename T>() { attention_backward<T>(in, out, a); });
}

TS_REGISTER_KERNEL(cpu, attention, attention_kernel);
TS_REGISTER_KERNEL(cpu, attention_backward, attention_backward_kernel);

}  // namespace
}  // namespace tessera::cpu
