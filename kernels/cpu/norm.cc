// CPU layer_norm forward and backward, fused: one pass for the row statistics, one for the
// output; the backward computes all three gradients in two passes over each row.
// add_layer_norm is the forward on s = x + r, each row's sum written (rounded to the dtype,
// as add rounds it) and then normalised while it is in cache.
// Parameter gradients are summed over fixed blocks of rows and the blocks merged in order,
// so they do not depend on the thread count. Row sums are f64 in eight lanes (sum8).
#include <cmath>

#include "kernels/cpu/parallel.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"

namespace tessera::cpu {
namespace {

constexpr int64_t kRowBlock = 32;

// sum_i f(i) for i in [0, n), in f64: eight running sums (element i into sum i % 8, so the
// compiler keeps them in vector registers instead of a chain of dependent additions),
// added pairwise in a fixed order at the end. Deterministic, as accurate as one f64 sum.
template <typename F>
inline double sum8(int64_t n, F&& f) {
  double acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += f(i + j);
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += f(i);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

struct RowsCols {
  int64_t rows, cols;
};

RowsCols rows_cols(const Tensor& x, int64_t nd) {
  int64_t cols = 1;
  for (int64_t i = x.dim() - nd; i < x.dim(); ++i) cols *= x.shape()[i];
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

// With a residual rt (add_layer_norm), the rows normalised are those of s = x + r, written
// to st first.
template <typename T>
void layer_norm_fwd(const Tensor& xt, const Tensor& wt, const Tensor& bt, const Tensor& y,
                    const Tensor& mean_t, const Tensor& rstd_t, int64_t nd, double eps,
                    const Tensor& rt = Tensor(), const Tensor& st = Tensor()) {
  using C = compute_t<T>;
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Tensor x = contiguous_cpu(xt);
  const Tensor res = rt.defined() ? contiguous_cpu(rt) : Tensor();
  const T* resp = res.defined() ? static_cast<const T*>(res.raw_data()) : nullptr;
  T* sp = st.defined() ? static_cast<T*>(st.raw_data()) : nullptr;
  const Tensor w = wt.defined() ? contiguous_cpu(wt) : Tensor();
  const Tensor b = bt.defined() ? contiguous_cpu(bt) : Tensor();
  // Plain variables, not a structured binding: the lambdas below capture them, which
  // clang before 16 rejects for bindings.
  const RowsCols rc = rows_cols(x, nd);
  const int64_t rows = rc.rows, cols = rc.cols;
  const T* xp = static_cast<const T*>(x.raw_data());
  const T* wp = w.defined() ? static_cast<const T*>(w.raw_data()) : nullptr;
  const T* bp = b.defined() ? static_cast<const T*>(b.raw_data()) : nullptr;
  T* yp = static_cast<T*>(y.raw_data());
  S* mp = static_cast<S*>(mean_t.raw_data());
  S* rp = static_cast<S*>(rstd_t.raw_data());
  parallel_for(0, rows, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1)),
               [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * cols;
      if (resp != nullptr) {
        T* sr = sp + r * cols;
        const T* rr = resp + r * cols;
        for (int64_t i = 0; i < cols; ++i) sr[i] = T(C(xr[i]) + C(rr[i]));
        xr = sr;
      }
      const double sum = sum8(cols, [&](int64_t i) { return static_cast<double>(C(xr[i])); });
      const double mean = sum / static_cast<double>(cols);
      const double sq = sum8(cols, [&](int64_t i) {
        const double d = static_cast<double>(C(xr[i])) - mean;
        return d * d;
      });
      const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(cols) + eps);
      mp[r] = static_cast<S>(mean);
      rp[r] = static_cast<S>(rstd);
      const C cm = static_cast<C>(mean), cr = static_cast<C>(rstd);
      T* yr = yp + r * cols;
      for (int64_t i = 0; i < cols; ++i) {
        C v = (C(xr[i]) - cm) * cr;
        if (wp) v *= C(wp[i]);
        if (bp) v += C(bp[i]);
        yr[i] = T(v);
      }
    }
  });
}

void layer_norm_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_float_dtype(in[0].dtype(), "layer_norm", [&]<typename T>() {
    layer_norm_fwd<T>(in[0], in[1], in[2], out[0], out[1], out[2], a.normalized_ndim, a.eps);
  });
}

// dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)); dw = sum(g*xhat); db = sum(g).
// With a residual_grad (input 6), dx is then rounded and the residual_grad added.
template <typename T>
void layer_norm_bwd(std::span<const Tensor> in, std::span<Tensor> out, int64_t nd) {
  using C = compute_t<T>;
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const Tensor g = contiguous_cpu(in[0]);
  const Tensor x = contiguous_cpu(in[1]);
  const Tensor mean = contiguous_cpu(in[2]);
  const Tensor rstd = contiguous_cpu(in[3]);
  const Tensor w = in[4].defined() ? contiguous_cpu(in[4]) : Tensor();
  const Tensor res = in.size() > 6 && in[6].defined() ? contiguous_cpu(in[6]) : Tensor();
  const T* resp = res.defined() ? static_cast<const T*>(res.raw_data()) : nullptr;
  // Plain variables, not a structured binding: the lambdas below capture them, which
  // clang before 16 rejects for bindings.
  const RowsCols rc = rows_cols(x, nd);
  const int64_t rows = rc.rows, cols = rc.cols;
  const T* gp = static_cast<const T*>(g.raw_data());
  const T* xp = static_cast<const T*>(x.raw_data());
  const S* mp = static_cast<const S*>(mean.raw_data());
  const S* rp = static_cast<const S*>(rstd.raw_data());
  const T* wp = w.defined() ? static_cast<const T*>(w.raw_data()) : nullptr;
  T* dxp = static_cast<T*>(out[0].raw_data());
  const bool want_w = out[1].defined(), want_b = out[2].defined();
  const int64_t nblocks = (rows + kRowBlock - 1) / kRowBlock;
  // Per-block partial sums for dw and db, merged in block order below.
  std::vector<double> dw_part(want_w ? nblocks * cols : 0), db_part(want_b ? nblocks * cols : 0);
  parallel_for(0, nblocks, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols * kRowBlock, 1)),
               [&](int64_t blk0, int64_t blk1) {
    std::vector<C> xhat(cols), gw(cols);
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      double* dwb = want_w ? dw_part.data() + blk * cols : nullptr;
      double* dbb = want_b ? db_part.data() + blk * cols : nullptr;
      for (int64_t r = blk * kRowBlock; r < std::min(rows, (blk + 1) * kRowBlock); ++r) {
        const T* gr = gp + r * cols;
        const T* xr = xp + r * cols;
        const C m = static_cast<C>(mp[r]), rs = static_cast<C>(rp[r]);
        for (int64_t i = 0; i < cols; ++i) {
          xhat[i] = (C(xr[i]) - m) * rs;
          gw[i] = wp ? C(gr[i]) * C(wp[i]) : C(gr[i]);
        }
        if (dwb) {
          for (int64_t i = 0; i < cols; ++i) dwb[i] += static_cast<double>(C(gr[i])) * xhat[i];
        }
        if (dbb) {
          for (int64_t i = 0; i < cols; ++i) dbb[i] += static_cast<double>(C(gr[i]));
        }
        const double sum_gw = sum8(cols, [&](int64_t i) { return static_cast<double>(gw[i]); });
        const double sum_gwx =
            sum8(cols, [&](int64_t i) { return static_cast<double>(gw[i]) * xhat[i]; });
        const C mean_gw = static_cast<C>(sum_gw / cols), mean_gwx = static_cast<C>(sum_gwx / cols);
        T* dxr = dxp + r * cols;
        for (int64_t i = 0; i < cols; ++i) dxr[i] = T(rs * (gw[i] - mean_gw - xhat[i] * mean_gwx));
        if (resp != nullptr) {  // + residual_grad, as an add of the rounded grad_x
          const T* rr = resp + r * cols;
          for (int64_t i = 0; i < cols; ++i) dxr[i] = T(C(dxr[i]) + C(rr[i]));
        }
      }
    }
  });
  auto merge = [&](const std::vector<double>& part, const Tensor& dst) {
    T* d = static_cast<T*>(dst.raw_data());
    for (int64_t i = 0; i < cols; ++i) {
      double s = 0;
      for (int64_t blk = 0; blk < nblocks; ++blk) s += part[blk * cols + i];
      d[i] = T(static_cast<C>(s));
    }
  };
  if (want_w) merge(dw_part, out[1]);
  if (want_b) merge(db_part, out[2]);
}

void layer_norm_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                const Attrs& a) {
  visit_float_dtype(in[1].dtype(), "layer_norm_backward", [&]<typename T>() {
    layer_norm_bwd<T>(in, out, a.normalized_ndim);
  });
}

TS_REGISTER_KERNEL(cpu, layer_norm, layer_norm_kernel);
TS_REGISTER_KERNEL(cpu, layer_norm_backward, layer_norm_backward_kernel);

// Inputs: x, r, weight, bias. Outputs: s, y, mean, rstd.
void add_layer_norm_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  visit_float_dtype(in[0].dtype(), "add_layer_norm", [&]<typename T>() {
    layer_norm_fwd<T>(in[0], in[2], in[3], out[1], out[2], out[3], a.normalized_ndim, a.eps,
                      in[1], out[0]);
  });
}

TS_REGISTER_KERNEL(cpu, add_layer_norm, add_layer_norm_kernel);

}  // namespace
}  // namespace tessera::cpu
