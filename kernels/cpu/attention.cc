// CPU attention: the fused scaled dot-product attention op (tensor/ops.h). Parallel over the
// B * H (batch, head) pairs. f64 runs plain loops per pair (the spec, below); the other
// dtypes compute in f32 (16-bit inputs widened once, results rounded once) as blocks of
// query rows through the project's GEMM: scores for a block of rows against the keys it may
// see, a row softmax, then products with V (forward) or the five products of the backward,
// with P recomputed from the saved lse (exp over packets: vec_math.h); f32 heads are read in
// place through their strides (PairRows), and every dtype's outputs are written through
// theirs (OutRows). attention_qkv runs the same code on views: q, k and v are heads of the
// packed [3, B, T, C] input, out the heads of [B, T, C], the gradients the heads of one
// [3, B, T, C] tensor. The blocking is fixed by T alone. A causal block's products skip
// the work above the diagonal in whole GEMM register tiles (GemmBand, gemm.h), so only the
// tiles the diagonal crosses compute masked entries. Unlike the spec, such a tile multiplies
// the zero P or dS of a query i against a future key j (j - i below the GEMM's kMR: 6 with
// AVX2, 12 with AVX-512, 4 in the scalar build) with that key's or query's values. So a
// non-finite v_j or k_j reaches out_i or dq_i as NaN, and a non-finite dO_i or q_i reaches
// dv_j or dk_j, where the spec leaves them finite.
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
#include "tensor/grad_mode.h"
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

// a . b in the GEMM's order and rounding: from 0, one fused multiply-add per term (a multiply
// and an add where the build's GEMM has no FMA). So D_i = dO_i . O_i and the GEMM's
// dP_ij = dO_i . v_j are the same bits when O_i = v_j (a row whose one visible key is j: a
// causal first query), and dS_ij = P_ij (dP_ij - D_i) is exactly 0, as in exact arithmetic
// (for head sizes up to the GEMM's K block, 384: past it the GEMM adds blocks' partial sums).
inline float gemm_term(float a, float b, float s) {
#if defined(__FMA__)
  return std::fma(a, b, s);
#else
  return s + a * b;
#endif
}
inline float gemm_dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t d = 0; d < n; ++d) s = gemm_term(a[d], b[d], s);
  return s;
}

// di[r] = gemm_dot(a + r * as, b + r * bs, n) for r in [0, rows), eight rows' chains
// interleaved: one row's chain of n dependent multiply-adds leaves the FMA units idle for
// its latency, eight keep them busy. Each row's own sum is unchanged, so the bits are
// gemm_dot's.
void gemm_dots(const float* a, int64_t as, const float* b, int64_t bs, int64_t rows, int64_t n,
               float* di) {
  constexpr int kChains = 8;
  int64_t r = 0;
  for (; r + kChains <= rows; r += kChains) {
    const float* ar = a + r * as;
    const float* br = b + r * bs;
    float s[kChains] = {};
    for (int64_t d = 0; d < n; ++d) {
      for (int u = 0; u < kChains; ++u) s[u] = gemm_term(ar[u * as + d], br[u * bs + d], s[u]);
    }
    for (int u = 0; u < kChains; ++u) di[r + u] = s[u];
  }
  for (; r < rows; ++r) di[r] = gemm_dot(a + r * as, b + r * bs, n);
}

// Stores n compute-type values into `dst` (dtype T) with one rounding each.
template <typename T, typename C>
void store(T* dst, const C* src, int64_t n) {
  if constexpr (is_low_precision_v<T> && std::is_same_v<C, float>) return narrow_run(src, dst, n);
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

// A [B, H, T, D] output written per pair, its last dim contiguous: attention's own
// contiguous outputs, or heads of attention_qkv's [B, T, C] and [3, B, T, C] ones.
template <typename T>
struct OutRows {
  T* data;
  int64_t heads, batch_stride, head_stride, row_stride;

  explicit OutRows(const Tensor& t)
      : data(static_cast<T*>(t.raw_data())), heads(t.shape()[1]), batch_stride(t.strides()[0]),
        head_stride(t.strides()[1]), row_stride(t.strides()[2]) {}
  T* row(int64_t p, int64_t i) const {
    return data + (p / heads) * batch_stride + (p % heads) * head_stride + i * row_stride;
  }
  // Rows [i, i + n) of pair p from n x dh compute-type values, one rounding each.
  template <typename C>
  void store_rows(int64_t p, int64_t i, const C* src, int64_t n, int64_t dh) const {
    for (int64_t r = 0; r < n; ++r) store(row(p, i + r), src + r * dh, dh);
  }
};

// The keys rows [i0, i1) may see.
int64_t keys_for(bool causal, int64_t i1, int64_t t) { return causal ? i1 : t; }

// A causal block's products from query i0 on (none without the mask): the scores and their
// gradient are wanted on the band j <= i0 + r (kLowerC); P and dS are zero past it, so
// products with them as A leave those terms out (kLowerA), and so do their transposes, zero
// before it (kUpperA, r >= j - i0).
struct Bands {
  bool causal;
  GemmBand c, a, at;
  Bands(bool causal, int64_t i0)
      : causal(causal), c{GemmBand::kLowerC, i0}, a{GemmBand::kLowerA, i0}, at{GemmBand::kUpperA, i0} {}
  const GemmBand* lower_c() const { return causal ? &c : nullptr; }
  const GemmBand* lower_a() const { return causal ? &a : nullptr; }
  const GemmBand* upper_a() const { return causal ? &at : nullptr; }
};

// Row softmax of scale * s in place over s [rows, ld] (columns [0, keys)), rows r at query
// i0 + r masked to columns <= i0 + r when causal; writes the row's lse. Masked columns become
// exact zeros. The scores are scaled first, each rounded once as the spec rounds them (an
// exp of scale * s - max would fuse into one rounding and change the bits).
void softmax_rows(float* s, int64_t rows, int64_t ld, int64_t keys, int64_t i0, bool causal,
                  float scale, float* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    const int64_t n = causal ? std::min(keys, i0 + r + 1) : keys;
    for (int64_t j = 0; j < n; ++j) row[j] *= scale;
    const float mx = extreme_of(row, n, /*largest=*/true);
    const float sum = exp_affine(row, row, n, 1.0f, mx);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; ++j) row[j] *= inv;
    std::fill(row + n, row + keys, 0.0f);
    lse[r] = mx + std::log(sum);
  }
}

// Forward operands: q, k, v [B, H, T, D] (views), out (the same, written through its
// strides) and lse [B, H, T] (contiguous).
struct Forward {
  Tensor q, k, v, out, lse;
};

template <typename T>
void attention_forward_f32(const Forward& f, const Attrs& a) {
  const PairRows q(f.q), k(f.k), v(f.v);
  const Shape& shape = f.q.shape();
  const int64_t bh = shape[0] * shape[1], t = shape[2], dh = shape[3];
  const float scale = static_cast<float>(effective_scale(a, dh));
  const OutRows<T> op(f.out);
  float* lp = static_cast<float*>(f.lse.raw_data());
  parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kRows * t), o(std::is_same_v<T, float> ? 0 : kRows * dh);
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t i0 = 0; i0 < t; i0 += kRows) {
        const int64_t rows = std::min(kRows, t - i0), keys = keys_for(a.causal, i0 + rows, t);
        const Bands band(a.causal, i0);
        // s = q k^T; the softmax scales each dot product (rounded once) as the spec does.
        sgemm(rows, keys, dh, q.rows(p, i0), k.cols(p, 0), s.data(), t, false, nullptr, band.lower_c());
        softmax_rows(s.data(), rows, t, keys, i0, a.causal, scale, lp + p * t + i0);
        if constexpr (std::is_same_v<T, float>) {
          sgemm(rows, dh, keys, {s.data(), t, 1}, v.rows(p, 0), op.row(p, i0), op.row_stride, false,
                nullptr, band.lower_a());
        } else {
          sgemm(rows, dh, keys, {s.data(), t, 1}, v.rows(p, 0), o.data(), dh, false, nullptr,
                band.lower_a());
          op.store_rows(p, i0, o.data(), rows, dh);
        }
      }
    }
  });
}

// Backward operands: grad, q, k, v, out [B, H, T, D] (views), lse [B, H, T], and the
// gradients dq, dk, dv (written through their strides).
struct Backward {
  Tensor grad, q, k, v, out, lse, dq, dk, dv;
};

template <typename T>
void attention_backward_f32(const Backward& b, const Attrs& a) {
  const PairRows g(b.grad), q(b.q), k(b.k), v(b.v), o(b.out);
  const Tensor lse = contiguous_cpu(b.lse);
  const Shape& shape = b.q.shape();
  const int64_t bh = shape[0] * shape[1], t = shape[2], dh = shape[3];
  const float scale = static_cast<float>(effective_scale(a, dh));
  const float* lp = static_cast<const float*>(lse.raw_data());
  const OutRows<T> dq_out(b.dq), dk_out(b.dk), dv_out(b.dv);
  parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> prob(kRows * t), ds(kRows * t), dq(kRows * dh), dk(t * dh), dv(t * dh), di(kRows);
    for (int64_t p = begin; p < end; ++p) {
      std::fill(dk.begin(), dk.end(), 0.0f);
      std::fill(dv.begin(), dv.end(), 0.0f);
      for (int64_t i0 = 0; i0 < t; i0 += kRows) {
        const int64_t rows = std::min(kRows, t - i0), keys = keys_for(a.causal, i0 + rows, t);
        const Bands band(a.causal, i0);
        // P = exp(scale q k^T - lse), masked entries exact zeros.
        sgemm(rows, keys, dh, q.rows(p, i0), k.cols(p, 0), prob.data(), t, false, nullptr,
              band.lower_c());
        for (int64_t r = 0; r < rows; ++r) {
          float* row = prob.data() + r * t;
          const int64_t n = a.causal ? std::min(keys, i0 + r + 1) : keys;
          const float li = lp[p * t + i0 + r];
          exp_affine(row, row, n, scale, li);
          std::fill(row + n, row + keys, 0.0f);
        }
        gemm_dots(g.row(p, i0), g.row_stride, o.row(p, i0), o.row_stride, rows, dh, di.data());
        // dv[0, keys) += P^T dO.
        sgemm(keys, dh, rows, {prob.data(), 1, t}, g.rows(p, i0), dv.data(), dh,
              /*accumulate=*/true, nullptr, band.upper_a());
        // dS = scale P (dO v^T - D).
        sgemm(rows, keys, dh, g.rows(p, i0), v.cols(p, 0), ds.data(), t, false, nullptr,
              band.lower_c());
        for (int64_t r = 0; r < rows; ++r) {
          float* dsr = ds.data() + r * t;
          const float* pr = prob.data() + r * t;
          const int64_t n = a.causal ? std::min(keys, i0 + r + 1) : keys;
          for (int64_t j = 0; j < n; ++j) dsr[j] = scale * (pr[j] * (dsr[j] - di[r]));
          std::fill(dsr + n, dsr + keys, 0.0f);
        }
        // dq = dS k; dk[0, keys) += dS^T q.
        if constexpr (std::is_same_v<T, float>) {
          sgemm(rows, dh, keys, {ds.data(), t, 1}, k.rows(p, 0), dq_out.row(p, i0), dq_out.row_stride,
                false, nullptr, band.lower_a());
        } else {
          sgemm(rows, dh, keys, {ds.data(), t, 1}, k.rows(p, 0), dq.data(), dh, false, nullptr,
                band.lower_a());
          dq_out.store_rows(p, i0, dq.data(), rows, dh);
        }
        sgemm(keys, dh, rows, {ds.data(), 1, t}, q.rows(p, i0), dk.data(), dh, /*accumulate=*/true,
              nullptr, band.upper_a());
      }
      dk_out.store_rows(p, 0, dk.data(), t, dh);
      dv_out.store_rows(p, 0, dv.data(), t, dh);
    }
  });
}

// ---- the spec: plain loops (f64) ---------------------------------------------------------------

template <typename T>
void attention_forward(const Forward& f, const Attrs& a) {
  using C = compute_t<T>;
  const Tensor q = to_compute_cpu(f.q), k = to_compute_cpu(f.k), v = to_compute_cpu(f.v);
  const int64_t bh = q.shape()[0] * q.shape()[1], t = q.shape()[2], dh = q.shape()[3];
  const C scale = static_cast<C>(effective_scale(a, dh));
  const C* qp = static_cast<const C*>(q.raw_data());
  const C* kp = static_cast<const C*>(k.raw_data());
  const C* vp = static_cast<const C*>(v.raw_data());
  const OutRows<T> op(f.out);
  C* lp = static_cast<C*>(f.lse.raw_data());  // f32, or f64 for f64
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
        store(op.row(p, i), acc.data(), dh);
        lp[p * t + i] = mx + std::log(sum);
      }
    }
  });
}

void run_forward(const char* name, const Forward& f, const Attrs& a) {
  visit_float_dtype(f.q.dtype(), name, [&]<typename T>() {
    if constexpr (std::is_same_v<compute_t<T>, float>) attention_forward_f32<T>(f, a);
    else attention_forward<T>(f, a);
  });
}

template <typename T>
void attention_backward(const Backward& b, const Attrs& a) {
  using C = compute_t<T>;
  const Tensor g = to_compute_cpu(b.grad), q = to_compute_cpu(b.q), k = to_compute_cpu(b.k);
  const Tensor v = to_compute_cpu(b.v), o = to_compute_cpu(b.out);
  const Tensor lse = contiguous_cpu(b.lse);
  const int64_t bh = q.shape()[0] * q.shape()[1], t = q.shape()[2], dh = q.shape()[3];
  const C scale = static_cast<C>(effective_scale(a, dh));
  const C* gp = static_cast<const C*>(g.raw_data());
  const C* qp = static_cast<const C*>(q.raw_data());
  const C* kp = static_cast<const C*>(k.raw_data());
  const C* vp = static_cast<const C*>(v.raw_data());
  const C* opp = static_cast<const C*>(o.raw_data());
  const C* lp = static_cast<const C*>(lse.raw_data());
  const OutRows<T> dq_out(b.dq), dk_out(b.dk), dv_out(b.dv);
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
        store(dq_out.row(p, i), dq.data(), dh);
      }
      for (C& x : dk) x *= scale;
      dk_out.store_rows(p, 0, dk.data(), t, dh);
      dv_out.store_rows(p, 0, dv.data(), t, dh);
    }
  });
}

void run_backward(const char* name, const Backward& b, const Attrs& a) {
  visit_float_dtype(b.q.dtype(), name, [&]<typename T>() {
    if constexpr (std::is_same_v<compute_t<T>, float>) attention_backward_f32<T>(b, a);
    else attention_backward<T>(b, a);
  });
}

void attention_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  run_forward("attention", {in[0], in[1], in[2], out[0], out[1]}, a);
}

// Inputs: grad, q, k, v, out, lse. Outputs: grad_q, grad_k, grad_v.
void attention_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                               const Attrs& a) {
  run_backward("attention_backward",
               {in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1], out[2]}, a);
}

// ---- attention_qkv: the same kernels on views of the packed tensors ---------------------------

// The kernels below take their views (attention_heads) under NoGradGuard: the inputs may
// require grad, and a view made with grad on would be recorded.
void attention_qkv_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  NoGradGuard no_grad;
  const Tensor qkv = contiguous_cpu(in[0]);
  const int64_t hd = a.head_dim;
  run_forward("attention_qkv",
              {attention_heads(qkv, 0, hd), attention_heads(qkv, 1, hd), attention_heads(qkv, 2, hd),
               attention_heads(out[0], hd), out[1]},
              a);
}

// Inputs: grad [B, T, C], qkv, out [B, T, C], lse. Output: grad_qkv [3, B, T, C].
void attention_qkv_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                   const Attrs& a) {
  NoGradGuard no_grad;
  const Tensor grad = contiguous_cpu(in[0]), qkv = contiguous_cpu(in[1]);
  const Tensor o = contiguous_cpu(in[2]);
  const int64_t hd = a.head_dim;
  run_backward("attention_qkv_backward",
               {attention_heads(grad, hd), attention_heads(qkv, 0, hd), attention_heads(qkv, 1, hd),
                attention_heads(qkv, 2, hd), attention_heads(o, hd), in[3],
                attention_heads(out[0], 0, hd), attention_heads(out[0], 1, hd),
                attention_heads(out[0], 2, hd)},
               a);
}

TS_REGISTER_KERNEL(cpu, attention, attention_kernel);
TS_REGISTER_KERNEL(cpu, attention_backward, attention_backward_kernel);
TS_REGISTER_KERNEL(cpu, attention_qkv, attention_qkv_kernel);
TS_REGISTER_KERNEL(cpu, attention_qkv_backward, attention_qkv_backward_kernel);

}  // namespace

Tensor attention_heads(const Tensor& x, int64_t head_dim) {
  const int64_t n = x.dim();
  return x.view({x.size(n - 3), x.size(n - 2), x.size(n - 1) / head_dim, head_dim}).transpose(1, 2);
}

}  // namespace tessera::cpu
