// CPU attention: the fused scaled dot-product attention op (tensor/ops.h). Parallel over the
// B * H (batch, head) pairs. f64 runs plain loops per pair (the spec, below); the other
// dtypes compute in f32 (16-bit inputs widened once, results rounded once) as blocks of
// query rows through the project's GEMM: scores for a block of rows against the keys it may
// see, a row softmax, then products with V (forward) or the five products of the backward,
// with P recomputed from the saved lse (exp over packets: vec_math.h); f32 heads are read in
// place through their strides (PairRows). The blocking is fixed by T alone. Unlike the
// spec, a causal block multiplies the zero probabilities of its rows' future keys (up to 63
// of them) with those keys' values, so a non-finite v_j (or dO_i) reaches rows i < j of its
// block as NaN, where the spec leaves them finite.
//
//   forward:  s_ij = scale q_i . k_j (j <= i when causal), lse_i = logsumexp_j s_ij,
//             out_i = sum_j exp(s_ij - lse_i) v_j
//   backward: P_ij = exp(s_ij - lse_i) from the saved lse, D_i = dO_i . O_i,
//             dS_ij = P_ij (dO_i . v_j - D_i); dq_i = scale sum_j dS_ij k_j,
//             dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dO_i
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "kernels/cpu/vec_math.h"
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

// ---- f32 through the GEMM -------------------------------------------------------------------
// Query rows per block: the scores of a block are [kRows, keys] f32 per thread.
constexpr int64_t kRows = 64;

// A [B, H, T, D] input seen per (batch, head) pair as a [T, D] matrix with its row stride:
// an f32 view whose last dim is contiguous (GPT's heads, transposed out of the qkv product)
// is read in place, anything else through one compute-dtype copy (`held`).
struct PairRows {
  Tensor held;
  const float* data = nullptr;
  int64_t heads = 1, batch_stride = 0, head_stride = 0, row_stride = 0;

  explicit PairRows(const Tensor& t) {
    const bool in_place = t.dtype() == DType::f32 && (t.shape()[3] == 1 || t.strides()[3] == 1);
    held = in_place ? t : to_compute_cpu(t);
    data = static_cast<const float*>(held.raw_data());
    heads = held.shape()[1];
    batch_stride = held.strides()[0];
    head_stride = held.strides()[1];
    row_stride = held.strides()[2];
  }
  // Pair p's row i.
  const float* row(int64_t p, int64_t i) const {
    return data + (p / heads) * batch_stride + (p % heads) * head_stride + i * row_stride;
  }
  StridedMatrix rows(int64_t p, int64_t i) const { return {row(p, i), row_stride, 1}; }
  StridedMatrix cols(int64_t p, int64_t i) const { return {row(p, i), 1, row_stride}; }
};

// The keys rows [i0, i1) may see.
int64_t keys_for(bool causal, int64_t i1, int64_t t) { return causal ? i1 : t; }

// Row softmax in place over s [rows, ld] (columns [0, keys)), rows r at query i0 + r masked
// to columns <= i0 + r when causal; writes the row's lse. Masked columns become exact zeros.
void softmax_rows(float* s, int64_t rows, int64_t ld, int64_t keys, int64_t i0, bool causal, float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const int64_t n = causal ? std::min(keys, i0 + r + 1) : keys;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
    const float sum = exp_affine(row, row, n, 1.0f, mx);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    std::fill(row + n, row + keys, 0.0f);
    lse[r] = mx + std::log(sum);
  }
}

template <typename T>
void attention_forward_f32(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const PairRows q(in[0]), k(in[1]), v(in[2]);
  const Shape& shape = in[0].shape();
  const int64_t bh = shape[0] * shape[1], t = shape[2], dh = shape[3];
  const float scale = static_cast<float>(effective_scale(a, dh));
  T* op = static_cast<T*>(out[0].raw_data());
  float* lp = static_cast<float*>(out[1].raw_data());
  parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kRows * t), o(std::is_same_v<T, float> ? 0 : kRows * dh);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t base = p * t * dh;
      for (int64_t i0 = 0; i0 < t; i0 += kRows) {
        const int64_t rows = std::min(kRows, t - i0), keys = keys_for(a.causal, i0 + rows, t);
        // s = scale (q k^T), the scale applied to each dot product as the spec does.
        sgemm(rows, keys, dh, q.rows(p, i0), k.cols(p, 0), s.data(), t);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = s.data() + r * t;
          for (int64_t j = 0; j < keys; ++j) row[j] *= scale;
        }
        softmax_rows(s.data(), rows, t, keys, i0, a.causal, lp + p * t + i0);
        if constexpr (std::is_same_v<T, float>) {
          sgemm(rows, dh, keys, {s.data(), t, 1}, v.rows(p, 0), op + base + i0 * dh, dh);
        } else {
          sgemm(rows, dh, keys, {s.data(), t, 1}, v.rows(p, 0), o.data(), dh);
          store(op + base + i0 * dh, o.data(), rows * dh);
        }
      }
    }
  });
}

// Inputs: grad, q, k, v, out, lse. Outputs: grad_q, grad_k, grad_v.
template <typename T>
void attention_backward_f32(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const PairRows g(in[0]), q(in[1]), k(in[2]), v(in[3]), o(in[4]);
  const Tensor lse = contiguous_cpu(in[5]);
  const Shape& shape = in[1].shape();
  const int64_t bh = shape[0] * shape[1], t = shape[2], dh = shape[3];
  const float scale = static_cast<float>(effective_scale(a, dh));
  const float* lp = static_cast<const float*>(lse.raw_data());
  T* dq_out = static_cast<T*>(out[0].raw_data());
  T* dk_out = static_cast<T*>(out[1].raw_data());
  T* dv_out = static_cast<T*>(out[2].raw_data());
  parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> prob(kRows * t), ds(kRows * t), dq(kRows * dh), dk(t * dh), dv(t * dh), di(kRows);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t base = p * t * dh;
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (int64_t i0 = 0; i0 < t; i0 += kRows) {
        const int64_t rows = std::min(kRows, t - i0), keys = keys_for(a.causal, i0 + rows, t);
        // P = exp(scale q k^T - lse), masked entries exact zeros.
        sgemm(rows, keys, dh, q.rows(p, i0), k.cols(p, 0), prob.data(), t);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = prob.data() + r * t;
          const int64_t n = a.causal ? std::min(keys, i0 + r + 1) : keys;
          const float li = lp[p * t + i0 + r];
          exp_affine(row, row, n, scale, li);
          std::fill(row + n, row + keys, 0.0f);
          di[r] = dot(g.row(p, i0 + r), o.row(p, i0 + r), dh);
        }
        // dv[0, keys) += P^T dO.
        sgemm(keys, dh, rows, {prob.data(), 1, t}, g.rows(p, i0), dv.data(), dh,
              /*accumulate=*/true);
        // dS = scale P (dO v^T - D).
        sgemm(rows, keys, dh, g.rows(p, i0), v.cols(p, 0), ds.data(), t);
        for (int64_t r = 0; r < rows; ++r) {
          float* dsr = ds.data() + r * t;
          const float* pr = prob.data() + r * t;
          const int64_t n = a.causal ? std::min(keys, i0 + r + 1) : keys;
          for (int64_t j = 0; j < n; ++j) dsr[j] = scale * (pr[j] * (dsr[j] - di[r]));
          std::fill(dsr + n, dsr + keys, 0.0f);
        }
        // dq = dS k; dk[0, keys) += dS^T q.
        if constexpr (std::is_same_v<T, float>) {
          sgemm(rows, dh, keys, {ds.data(), t, 1}, k.rows(p, 0), dq_out + base + i0 * dh, dh);
        } else {
          sgemm(rows, dh, keys, {ds.data(), t, 1}, k.rows(p, 0), dq.data(), dh);
          store(dq_out + base + i0 * dh, dq.data(), rows * dh);
        }
        sgemm(keys, dh, rows, {ds.data(), 1, t}, q.rows(p, i0), dk.data(), dh, /*accumulate=*/true);
      }
      store(dk_out + base, dk.data(), t * dh);
      store(dv_out + base, dv.data(), t * dh);
    }
  });
}

// ---- the spec: plain loops (f64) ---------------------------------------------------------------

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
  visit_float_dtype(in[0].dtype(), "attention", [&]<typename T>() {
    if constexpr (std::is_same_v<compute_t<T>, float>) attention_forward_f32<T>(in, out, a);
    else attention_forward<T>(in, out, a);
  });
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
  visit_float_dtype(in[1].dtype(), "attention_backward", [&]<typename T>() {
    if constexpr (std::is_same_v<compute_t<T>, float>) attention_backward_f32<T>(in, out, a);
    else attention_backward<T>(in, out, a);
  });
}

TS_REGISTER_KERNEL(cpu, attention, attention_kernel);
TS_REGISTER_KERNEL(cpu, attention_backward, attention_backward_kernel);

}  // namespace
}  // namespace tessera::cpu
