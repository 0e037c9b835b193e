// The f64 reference: matmul, softmax, layer_norm, cross_entropy, conv2d, max_pool2d (and
// their backward ops).
#include <cmath>
#include <limits>
#include <stdexcept>

#include "tests/reference/reference.h"

namespace tessera::ref {

NdArray matmul(const NdArray& a_in, const NdArray& b_in) {
  if (a_in.ndim() == 0 || b_in.ndim() == 0) throw std::invalid_argument("ref::matmul: 0-d");
  NdArray a = a_in, b = b_in;
  const bool vec_a = a.ndim() == 1, vec_b = b.ndim() == 1;
  if (vec_a) a.shape.insert(a.shape.begin(), 1);
  if (vec_b) b.shape.push_back(1);
  const int64_t m = a.shape[a.ndim() - 2], k = a.shape[a.ndim() - 1];
  const int64_t n = b.shape[b.ndim() - 1];
  if (b.shape[b.ndim() - 2] != k) throw std::invalid_argument("ref::matmul: inner dims");
  const Shape batch = broadcast_shape(Shape(a.shape.begin(), a.shape.end() - 2),
                                      Shape(b.shape.begin(), b.shape.end() - 2));
  Shape a_full = batch, b_full = batch;
  a_full.insert(a_full.end(), {m, k});
  b_full.insert(b_full.end(), {k, n});
  const NdArray A = broadcast_to(a, a_full), B = broadcast_to(b, b_full);
  Shape out_shape = batch;
  out_shape.insert(out_shape.end(), {m, n});
  NdArray out = NdArray::zeros(out_shape);
  const int64_t nb = count(batch);
  for (int64_t q = 0; q < nb; ++q) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < k; ++p)
          s += A.data[(q * m + i) * k + p] * B.data[(q * k + p) * n + j];
        out.data[(q * m + i) * n + j] = s;
      }
    }
  }
  if (vec_b) out.shape.pop_back();
  if (vec_a) out.shape.erase(out.shape.end() - (vec_b ? 1 : 2));
  return out;
}

namespace {

// Calls f(list of flat indices) for every line of x along dim.
template <typename F>
void for_each_line(const NdArray& x, int64_t dim, F&& f) {
  if (x.ndim() == 0) {
    f(std::vector<int64_t>{0});
    return;
  }
  const int64_t d = wrap_dim(dim, x.ndim());
  for (int64_t i = 0; i < x.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, x.shape);
    if (idx[d] != 0) continue;
    std::vector<int64_t> line;
    for (int64_t j = 0; j < x.shape[d]; ++j) {
      idx[d] = j;
      line.push_back(ravel(idx, x.shape));
    }
    f(line);
  }
}

double logsumexp(const std::vector<double>& v) {
  double m = -std::numeric_limits<double>::infinity();
  for (double a : v) m = std::max(m, a);
  double s = 0;
  for (double a : v) s += std::exp(a - m);
  return m + std::log(s);
}

}  // namespace

NdArray softmax(const NdArray& x, int64_t dim) {
  NdArray out = x;
  for_each_line(x, dim, [&](const std::vector<int64_t>& line) {
    std::vector<double> v;
    for (int64_t i : line) v.push_back(x.data[i]);
    const double lse = logsumexp(v);
    for (int64_t i : line) out.data[i] = std::exp(x.data[i] - lse);
  });
  return out;
}

NdArray log_softmax(const NdArray& x, int64_t dim) {
  NdArray out = x;
  for_each_line(x, dim, [&](const std::vector<int64_t>& line) {
    std::vector<double> v;
    for (int64_t i : line) v.push_back(x.data[i]);
    const double lse = logsumexp(v);
    for (int64_t i : line) out.data[i] = x.data[i] - lse;
  });
  return out;
}

std::vector<NdArray> layer_norm(const NdArray& x, const NdArray& weight, const NdArray& bias,
                                int64_t nd, double eps) {
  const Shape rows_shape(x.shape.begin(), x.shape.end() - nd);
  const int64_t rows = count(rows_shape), cols = count(Shape(x.shape.end() - nd, x.shape.end()));
  NdArray y = x, mean = NdArray::zeros(rows_shape), rstd = NdArray::zeros(rows_shape);
  for (int64_t r = 0; r < rows; ++r) {
    double mu = 0;
    for (int64_t c = 0; c < cols; ++c) mu += x.data[r * cols + c];
    mu /= static_cast<double>(cols);
    double v = 0;
    for (int64_t c = 0; c < cols; ++c)
      v += (x.data[r * cols + c] - mu) * (x.data[r * cols + c] - mu);
    v /= static_cast<double>(cols);
    const double rs = 1.0 / std::sqrt(v + eps);
    mean.data[r] = mu;
    rstd.data[r] = rs;
    for (int64_t c = 0; c < cols; ++c) {
      double o = (x.data[r * cols + c] - mu) * rs;
      if (weight.defined) o *= weight.data[c];
      if (bias.defined) o += bias.data[c];
      y.data[r * cols + c] = o;
    }
  }
  return {y, mean, rstd};
}

// y = xhat * w + b with xhat = (x - mean) * rstd, mean and rstd functions of the row:
// dx = rstd * (g w - mean(g w) - xhat * mean(g w xhat)), dw = sum_rows g xhat, db = sum_rows g.
std::vector<NdArray> layer_norm_backward(const NdArray& grad, const NdArray& x, const NdArray& mean,
                                         const NdArray& rstd, const NdArray& weight,
                                         const NdArray& bias, int64_t nd) {
  const Shape norm_shape(x.shape.end() - nd, x.shape.end());
  const int64_t cols = count(norm_shape), rows = cols == 0 ? 0 : x.numel() / cols;
  NdArray dx = NdArray::zeros(x.shape);
  NdArray dw = weight.defined ? NdArray::zeros(norm_shape) : NdArray::absent();
  NdArray db = bias.defined ? NdArray::zeros(norm_shape) : NdArray::absent();
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> xhat(cols), gw(cols);
    double mean_gw = 0, mean_gwx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      const double g = grad.data[r * cols + c];
      xhat[c] = (x.data[r * cols + c] - mean.data[r]) * rstd.data[r];
      gw[c] = weight.defined ? g * weight.data[c] : g;
      mean_gw += gw[c];
      mean_gwx += gw[c] * xhat[c];
      if (weight.defined) dw.data[c] += g * xhat[c];
      if (bias.defined) db.data[c] += g;
    }
    mean_gw /= static_cast<double>(cols);
    mean_gwx /= static_cast<double>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      dx.data[r * cols + c] = rstd.data[r] * (gw[c] - mean_gw - xhat[c] * mean_gwx);
    }
  }
  return {dx, dw, db};
}

std::vector<NdArray> cross_entropy(const NdArray& logits, const NdArray& target,
                                   Reduction reduction, int64_t ignore_index) {
  const int64_t n = logits.shape[0], c = logits.shape[1];
  NdArray per_row = NdArray::zeros({n}), lse = NdArray::zeros({n});
  double total = 0;
  int64_t counted = 0;
  for (int64_t r = 0; r < n; ++r) {
    const std::vector<double> row(logits.data.begin() + r * c, logits.data.begin() + (r + 1) * c);
    lse.data[r] = logsumexp(row);
    const int64_t t = static_cast<int64_t>(target.data[r]);
    if (t == ignore_index) continue;
    if (t < 0 || t >= c) throw std::out_of_range("ref::cross_entropy: target out of range");
    per_row.data[r] = lse.data[r] - row[t];
    total += per_row.data[r];
    ++counted;
  }
  if (reduction == Reduction::none) return {per_row, lse};
  const double loss = reduction == Reduction::sum ? total : total / static_cast<double>(counted);
  return {NdArray::of({}, {loss}), lse};
}

// d loss / d logits[r, i] = scale_r * (softmax_i - [i == t_r]); 0 for ignored rows, with
// scale_r = grad[r] (none), grad (sum) or grad / #counted rows (mean).
NdArray cross_entropy_backward(const NdArray& grad, const NdArray& logits, const NdArray& target,
                               const NdArray& lse, Reduction reduction, int64_t ignore_index) {
  const int64_t n = logits.shape[0], c = logits.shape[1];
  int64_t counted = 0;
  for (int64_t r = 0; r < n; ++r) counted += static_cast<int64_t>(target.data[r]) != ignore_index;
  NdArray dx = NdArray::zeros(logits.shape);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = static_cast<int64_t>(target.data[r]);
    if (t == ignore_index) continue;
    double scale = reduction == Reduction::none ? grad.data[r] : grad.data[0];
    if (reduction == Reduction::mean) scale /= static_cast<double>(counted);
    for (int64_t i = 0; i < c; ++i) {
      const double p = std::exp(logits.data[r * c + i] - lse.data[r]);
      dx.data[r * c + i] = scale * (p - (i == t ? 1.0 : 0.0));
    }
  }
  return dx;
}

namespace {
int64_t out_size(int64_t in, int64_t k, int64_t s, int64_t p) { return (in + 2 * p - k) / s + 1; }
}  // namespace

// out[n, o, y, x] = b[o] + sum_{c, i, j} w[o, c, i, j] * x[n, c, y*s - p + i, x*s - p + j].
NdArray conv2d(const NdArray& x, const NdArray& w, const NdArray& bias,
               std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  const int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  const int64_t O = w.shape[0], KH = w.shape[2], KW = w.shape[3];
  const int64_t OH = out_size(H, KH, stride[0], padding[0]);
  const int64_t OW = out_size(W, KW, stride[1], padding[1]);
  NdArray out = NdArray::zeros({N, O, OH, OW});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t y = 0; y < OH; ++y)
        for (int64_t xo = 0; xo < OW; ++xo) {
          double s = bias.defined ? bias.data[o] : 0.0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < KH; ++i)
              for (int64_t j = 0; j < KW; ++j) {
                const int64_t iy = y * stride[0] - padding[0] + i;
                const int64_t ix = xo * stride[1] - padding[1] + j;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                s += w.at({o, c, i, j}) * x.at({n, c, iy, ix});
              }
          out.at({n, o, y, xo}) = s;
        }
  return out;
}

// The adjoints of conv2d in x and in w: every (output, tap) pair scatters its product back.
// fn(n, o, y, xo, c, i, j, iy, ix) runs for each in-bounds tap, in one fixed order.
template <typename F>
void for_each_tap(const Shape& x, const Shape& w, const Shape& out, std::array<int64_t, 2> stride,
                  std::array<int64_t, 2> padding, F&& fn) {
  const int64_t N = x[0], C = x[1], H = x[2], W = x[3];
  const int64_t O = w[0], KH = w[2], KW = w[3];
  const int64_t OH = out[2], OW = out[3];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t y = 0; y < OH; ++y)
        for (int64_t xo = 0; xo < OW; ++xo)
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < KH; ++i)
              for (int64_t j = 0; j < KW; ++j) {
                const int64_t iy = y * stride[0] - padding[0] + i;
                const int64_t ix = xo * stride[1] - padding[1] + j;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                fn(n, o, y, xo, c, i, j, iy, ix);
              }
}

NdArray conv2d_backward_input(const NdArray& grad, const NdArray& w, const Shape& in_shape,
                              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  NdArray dx = NdArray::zeros(in_shape);
  for_each_tap(in_shape, w.shape, grad.shape, stride, padding,
               [&](int64_t n, int64_t o, int64_t y, int64_t xo, int64_t c, int64_t i, int64_t j,
                   int64_t iy, int64_t ix) {
                 dx.at({n, c, iy, ix}) += grad.at({n, o, y, xo}) * w.at({o, c, i, j});
               });
  return dx;
}

NdArray conv2d_backward_weight(const NdArray& grad, const NdArray& x, const Shape& w_shape,
                               std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  NdArray dw = NdArray::zeros(w_shape);
  for_each_tap(x.shape, w_shape, grad.shape, stride, padding,
               [&](int64_t n, int64_t o, int64_t y, int64_t xo, int64_t c, int64_t i, int64_t j,
                   int64_t iy, int64_t ix) {
                 dw.at({o, c, i, j}) += grad.at({n, o, y, xo}) * x.at({n, c, iy, ix});
               });
  return dw;
}

std::vector<NdArray> max_pool2d(const NdArray& x, std::array<int64_t, 2> kernel,
                                std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  const int64_t N = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  const int64_t OH = out_size(H, kernel[0], stride[0], padding[0]);
  const int64_t OW = out_size(W, kernel[1], stride[1], padding[1]);
  NdArray values = NdArray::zeros({N, C, OH, OW}), indices = NdArray::zeros({N, C, OH, OW});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < OH; ++y)
        for (int64_t xo = 0; xo < OW; ++xo) {
          bool found = false;
          double best = 0;
          int64_t arg = -1;
          for (int64_t i = 0; i < kernel[0]; ++i)
            for (int64_t j = 0; j < kernel[1]; ++j) {
              const int64_t iy = y * stride[0] - padding[0] + i;
              const int64_t ix = xo * stride[1] - padding[1] + j;
              if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
              const double v = x.at({n, c, iy, ix});
              if (!found || (!std::isnan(best) && (v > best || std::isnan(v)))) {
                found = true;
                best = v;
                arg = iy * W + ix;
              }
            }
          values.at({n, c, y, xo}) = best;
          indices.at({n, c, y, xo}) = static_cast<double>(arg);
        }
  return {values, indices};
}

NdArray max_pool2d_backward(const NdArray& grad, const NdArray& indices, const Shape& input_shape) {
  const int64_t N = grad.shape[0], C = grad.shape[1], OH = grad.shape[2], OW = grad.shape[3];
  const int64_t W = input_shape[3];
  NdArray dx = NdArray::zeros(input_shape);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < OH; ++y)
        for (int64_t xo = 0; xo < OW; ++xo) {
          const int64_t idx = static_cast<int64_t>(indices.at({n, c, y, xo}));
          dx.at({n, c, idx / W, idx % W}) += grad.at({n, c, y, xo});
        }
  return dx;
}

// ---- attention (naive, from the definition) -----------------------------------------------

AttentionRef::AttentionRef(const Shape& s, double sc, bool c)
    : bh(s[0] * s[1]), t(s[2]), d(s[3]), scale(sc != 0 ? sc : 1 / std::sqrt(double(s[3]))),
      causal(c) {}

double AttentionRef::dot(const NdArray& a, int64_t p, int64_t i, const NdArray& b, int64_t j) const {
  double s = 0;
  for (int64_t e = 0; e < d; ++e) s += a.data[(p * t + i) * d + e] * b.data[(p * t + j) * d + e];
  return s;
}

double AttentionRef::absdot(const NdArray& a, int64_t p, int64_t i, const NdArray& b, int64_t j) const {
  double s = 0;
  for (int64_t e = 0; e < d; ++e) {
    s += std::fabs(a.data[(p * t + i) * d + e] * b.data[(p * t + j) * d + e]);
  }
  return s;
}

std::vector<NdArray> AttentionRef::forward(const std::vector<NdArray>& in, bool mag) const {
  NdArray out = NdArray::zeros(in[0].shape), lse = NdArray::zeros({in[0].shape[0], in[0].shape[1], t});
  for (int64_t p = 0; p < bh; ++p) {
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> s(keys(i));
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < keys(i); ++j) mx = std::max(mx, s[j] = scale * dot(in[0], p, i, in[1], j));
      for (int64_t j = 0; j < keys(i); ++j) sum += std::exp(s[j] - mx);
      const double l = mx + std::log(sum);
      double lmag = 0;
      for (int64_t j = 0; j < keys(i); ++j) {
        const double prob = std::exp(s[j] - l);
        const double err =
            1 + std::fabs(s[j]) + std::fabs(l) + std::fabs(scale) * absdot(in[0], p, i, in[1], j);
        lmag = std::max(lmag, err);
        for (int64_t e = 0; e < d; ++e) {
          const double ve = in[2].data[(p * t + j) * d + e];
          out.data[(p * t + i) * d + e] += mag ? prob * std::fabs(ve) * err : prob * ve;
        }
      }
      lse.data[p * t + i] = mag ? lmag : l;
    }
  }
  return {out, lse};
}

std::vector<NdArray> AttentionRef::backward(const std::vector<NdArray>& in, bool mag) const {
  const NdArray &g = in[0], &q = in[1], &k = in[2], &v = in[3], &o = in[4], &lse = in[5];
  NdArray dq = NdArray::zeros(q.shape), dk = NdArray::zeros(q.shape), dv = NdArray::zeros(q.shape);
  auto f = [&](double x) { return mag ? std::fabs(x) : x; };
  for (int64_t p = 0; p < bh; ++p) {
    for (int64_t i = 0; i < t; ++i) {
      const double l = lse.data[p * t + i];
      const double di = mag ? absdot(g, p, i, o, i) : dot(g, p, i, o, i);
      for (int64_t j = 0; j < keys(i); ++j) {
        const double s = scale * dot(q, p, i, k, j), prob = std::exp(s - l);
        const double err =
            mag ? 1 + std::fabs(s) + std::fabs(l) + std::fabs(scale) * absdot(q, p, i, k, j) : 1;
        const double dp = mag ? absdot(g, p, i, v, j) : dot(g, p, i, v, j);
        const double ds = mag ? prob * err * (dp + di) : prob * (dp - di);
        for (int64_t e = 0; e < d; ++e) {
          const int64_t ie = (p * t + i) * d + e, je = (p * t + j) * d + e;
          dq.data[ie] += f(scale) * ds * f(k.data[je]);
          dk.data[je] += f(scale) * ds * f(q.data[ie]);
          dv.data[je] += prob * err * f(g.data[ie]);
        }
      }
    }
  }
  return {dq, dk, dv};
}

}  // namespace tessera::ref
