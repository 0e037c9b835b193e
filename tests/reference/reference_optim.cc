// The f64 reference: AdamW and SGD steps, written from the update rules in PyTorch's
// documentation of torch.optim.AdamW / torch.optim.SGD, one element at a time.
#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "tests/reference/reference.h"

namespace tessera::ref {

namespace {

void require_same_shape(const char* op, const NdArray& a, const NdArray& b) {
  if (a.shape != b.shape) throw std::invalid_argument(std::string(op) + ": shape mismatch");
}

}  // namespace

std::vector<NdArray> adamw(const NdArray& param, const NdArray& grad, const NdArray& exp_avg,
                           const NdArray& exp_avg_sq, int64_t t, double lr, double beta1,
                           double beta2, double eps, double weight_decay) {
  require_same_shape("ref::adamw", param, grad);
  require_same_shape("ref::adamw", param, exp_avg);
  require_same_shape("ref::adamw", param, exp_avg_sq);
  if (t < 1) throw std::invalid_argument("ref::adamw: t must be >= 1");
  NdArray p = param, m = exp_avg, v = exp_avg_sq;
  const double bc1 = 1 - std::pow(beta1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(beta2, static_cast<double>(t));
  for (int64_t i = 0; i < p.numel(); ++i) {
    const double g = grad.data[i];
    p.data[i] *= 1 - lr * weight_decay;
    m.data[i] = beta1 * m.data[i] + (1 - beta1) * g;
    v.data[i] = beta2 * v.data[i] + (1 - beta2) * g * g;
    const double m_hat = m.data[i] / bc1;
    const double denom = std::sqrt(v.data[i]) / std::sqrt(bc2) + eps;
    p.data[i] -= lr * m_hat / denom;
  }
  return {p, m, v};
}

std::vector<NdArray> sgd(const NdArray& param, const NdArray& grad, const NdArray& momentum_buffer,
                         int64_t t, double lr, double momentum, double dampening,
                         double weight_decay, bool nesterov) {
  require_same_shape("ref::sgd", param, grad);
  if (t < 1) throw std::invalid_argument("ref::sgd: t must be >= 1");
  const bool has_momentum = momentum != 0;
  if (has_momentum && t > 1) require_same_shape("ref::sgd", param, momentum_buffer);
  NdArray p = param;
  NdArray buf = has_momentum ? NdArray::zeros(param.shape) : NdArray::absent();
  for (int64_t i = 0; i < p.numel(); ++i) {
    double d = grad.data[i];
    if (weight_decay != 0) d += weight_decay * p.data[i];
    if (has_momentum) {
      const double b =
          t == 1 ? d : momentum * momentum_buffer.data[i] + (1 - dampening) * d;
      buf.data[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p.data[i] -= lr * d;
  }
  return {p, buf};
}

std::vector<double> dynamic_map(bool is_signed) {
  std::vector<double> out;
  for (int b = 0; b < 256; ++b) {
    const bool negative = is_signed && (b & 0x80);
    const int rest = is_signed ? (b & 0x7f) : b;
    const int bits = is_signed ? 7 : 8;
    double v;
    if (rest == 0) {
      v = negative ? 1.0 : 0.0;  // "minus zero" stands for 1
    } else if (!is_signed && rest == 1) {
      v = 1.0;  // the pattern whose exponent would be 10^-7
    } else {
      int e = 0;  // leading zeros below the sign
      while (!(rest & (1 << (bits - 1 - e)))) ++e;
      const int f = bits - 1 - e;
      const int j = rest & ((1 << f) - 1);
      v = std::pow(10.0, -e) * (0.1 + 0.9 * (j + 0.5) / std::ldexp(1.0, f));
      if (negative) v = -v;
    }
    out.push_back(static_cast<double>(static_cast<float>(v)));
  }
  std::sort(out.begin(), out.end());
  return out;
}

int nearest_code(const std::vector<double>& map, double x) {
  int code = 0;
  for (size_t k = 0; k + 1 < map.size(); ++k) code += x >= (map[k] + map[k + 1]) / 2 ? 1 : 0;
  return code;
}

namespace {

// AdamW's constants and one element's step in the state type S, as the kernel rounds them.
template <typename S>
struct Adam8Element {
  S decay, w1, b2, w2, bc2_sqrt, e, step_size;
  Adam8Element(int64_t t, double lr, double beta1, double beta2, double eps, double weight_decay) {
    const double tt = static_cast<double>(t);
    decay = S(1.0 - lr * weight_decay);
    w1 = S(1.0 - beta1);
    b2 = S(beta2);
    w2 = S(1.0 - beta2);
    bc2_sqrt = S(std::sqrt(1.0 - std::pow(beta2, tt)));
    e = S(eps);
    step_size = S(lr / (1.0 - std::pow(beta1, tt)));
  }
  // The moments from codes k1, k2 on scales s1, s2 and gradient g.
  std::pair<S, S> moments(double k1, double k2, S s1, S s2, S g) const {
    static const std::vector<double> map1 = dynamic_map(true), map2 = dynamic_map(false);
    S mi = S(map1[static_cast<size_t>(k1)]) * s1;
    mi = mi + w1 * (g - mi);
    const S vi = (S(map2[static_cast<size_t>(k2)]) * s2) * b2 + w2 * (g * g);
    return {mi, vi};
  }
  S param(S x, S mi, S vi) const {
    x = x * decay;
    const S denom = std::sqrt(vi) / bc2_sqrt + e;
    return x - step_size * (mi / denom);
  }
};

template <typename S>
std::vector<NdArray> adamw8bit_in(const std::vector<NdArray>& in, int64_t t, double lr,
                                  double beta1, double beta2, double eps, double weight_decay,
                                  DType dt) {
  static const std::vector<double> map1 = dynamic_map(true), map2 = dynamic_map(false);
  const bool master = in.size() > 6 && in[6].defined;
  NdArray p = in[0], c1 = in[2], c2 = in[3], a1 = in[4], a2 = in[5];
  NdArray w = master ? in[6] : NdArray();
  const Adam8Element<S> k(t, lr, beta1, beta2, eps, weight_decay);
  const int64_t n = p.numel();
  for (int64_t b0 = 0; b0 < n; b0 += 256) {
    const int64_t b = b0 / 256, len = std::min<int64_t>(256, n - b0);
    const S s1 = S(a1.data[b]), s2 = S(a2.data[b]);
    std::vector<S> m(len), v(len);
    S max1 = 0, max2 = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = b0 + j;
      const auto [mi, vi] = k.moments(c1.data[i], c2.data[i], s1, s2, S(in[1].data[i]));
      const S x = k.param(master ? S(w.data[i]) : S(p.data[i]), mi, vi);
      if (master) w.data[i] = x;
      p.data[i] = round_to(static_cast<double>(x), dt);
      m[j] = mi;
      v[j] = vi;
      max1 = std::max(max1, std::fabs(mi));
      max2 = std::max(max2, vi);
    }
    a1.data[b] = max1;
    a2.data[b] = max2;
    for (int64_t j = 0; j < len; ++j) {
      // The normalised value in the state type; 0 for an all-zero block.
      const S x1 = max1 > 0 ? m[j] / max1 : S(0), x2 = max2 > 0 ? v[j] / max2 : S(0);
      c1.data[b0 + j] = nearest_code(map1, static_cast<double>(x1));
      c2.data[b0 + j] = nearest_code(map2, static_cast<double>(x2));
    }
  }
  std::vector<NdArray> out = {p, c1, c2, a1, a2};
  if (master) out.push_back(w);
  return out;
}

template <typename S>
std::vector<NdArray> adamw8bit_segments_in(const std::vector<NdArray>& in, int pass, int64_t t,
                                           double lr, double beta1, double beta2, double eps,
                                           double weight_decay, DType dt) {
  static const std::vector<double> map1 = dynamic_map(true), map2 = dynamic_map(false);
  const bool master = in[6].defined;
  NdArray p = in[0], c1 = in[2], c2 = in[3], a1 = in[4], a2 = in[5], w = in[6];
  const NdArray& seg = in[7];
  NdArray n1 = in[8], n2 = in[9];
  const Adam8Element<S> k(t, lr, beta1, beta2, eps, weight_decay);
  if (pass == 1) n1 = NdArray::zeros(n1.shape), n2 = NdArray::zeros(n2.shape);
  int64_t start = 0;
  for (int64_t s = 0; s < seg.numel() / 2; ++s) {
    const int64_t end = static_cast<int64_t>(seg.data[2 * s]);
    const size_t b = static_cast<size_t>(seg.data[2 * s + 1]);
    S max1 = 0, max2 = 0;
    for (int64_t i = start; i < end; ++i) {
      const auto [mi, vi] =
          k.moments(c1.data[i], c2.data[i], S(a1.data[b]), S(a2.data[b]), S(in[1].data[i]));
      if (pass == 1) {
        const S x = k.param(master ? S(w.data[i]) : S(p.data[i]), mi, vi);
        if (master) w.data[i] = x;
        p.data[i] = round_to(static_cast<double>(x), dt);
        max1 = std::max(max1, std::fabs(mi));
        max2 = std::max(max2, vi);
      } else {
        const S d1 = S(n1.data[b]), d2 = S(n2.data[b]);
        c1.data[i] = nearest_code(map1, static_cast<double>(d1 > 0 ? mi / d1 : S(0)));
        c2.data[i] = nearest_code(map2, static_cast<double>(d2 > 0 ? vi / d2 : S(0)));
      }
    }
    if (pass == 1) n1.data[b] = max1, n2.data[b] = max2;
    start = end;
  }
  if (pass == 1) {
    std::vector<NdArray> out = {p};
    if (master) out.push_back(w);
    out.insert(out.end(), {n1, n2});
    return out;
  }
  return {c1, c2, n1, n2};  // the scales become the new ones
}

}  // namespace

std::vector<NdArray> adamw8bit_segments(const std::vector<NdArray>& in, int pass, int64_t t,
                                        double lr, double beta1, double beta2, double eps,
                                        double weight_decay, DType dt) {
  if (in.size() != 10) throw std::invalid_argument("ref::adamw8bit_segments: expected 10 inputs");
  if (pass != 1 && pass != 2) throw std::invalid_argument("ref::adamw8bit_segments: pass 1 or 2");
  if (dt == DType::f64) {
    return adamw8bit_segments_in<double>(in, pass, t, lr, beta1, beta2, eps, weight_decay, dt);
  }
  return adamw8bit_segments_in<float>(in, pass, t, lr, beta1, beta2, eps, weight_decay, dt);
}

std::vector<NdArray> adamw8bit(const std::vector<NdArray>& in, int64_t t, double lr,
                               double beta1, double beta2, double eps, double weight_decay,
                               DType dt) {
  if (in.size() < 6) throw std::invalid_argument("ref::adamw8bit: expected 6 or 7 inputs");
  if (t < 1) throw std::invalid_argument("ref::adamw8bit: t must be >= 1");
  if (dt == DType::f64) return adamw8bit_in<double>(in, t, lr, beta1, beta2, eps, weight_decay, dt);
  return adamw8bit_in<float>(in, t, lr, beta1, beta2, eps, weight_decay, dt);
}

}  // namespace tessera::ref
