// The f64 reference: arrays, dtype rounding, elementwise ops and reductions.
#include "tests/reference/reference.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace tessera::ref {

// ---- NdArray and index arithmetic --------------------------------------------------------

int64_t count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

NdArray NdArray::zeros(const Shape& shape, double fill) {
  NdArray a;
  a.shape = shape;
  a.data.assign(static_cast<size_t>(count(shape)), fill);
  return a;
}

NdArray NdArray::of(const Shape& shape, std::vector<double> data) {
  if (static_cast<int64_t>(data.size()) != count(shape)) {
    throw std::invalid_argument("ref::NdArray::of: data does not fill the shape");
  }
  NdArray a;
  a.shape = shape;
  a.data = std::move(data);
  return a;
}

NdArray NdArray::absent() {
  NdArray a;
  a.defined = false;
  return a;
}

std::vector<int64_t> unravel(int64_t flat, const Shape& shape) {
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    idx[d] = flat % shape[d];
    flat /= shape[d];
  }
  return idx;
}

int64_t ravel(const std::vector<int64_t>& idx, const Shape& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    assert(idx[d] >= 0 && idx[d] < shape[d]);
    flat = flat * shape[d] + idx[d];
  }
  return flat;
}

double& NdArray::at(const std::vector<int64_t>& idx) { return data[ravel(idx, shape)]; }
double NdArray::at(const std::vector<int64_t>& idx) const { return data[ravel(idx, shape)]; }

int64_t wrap_dim(int64_t dim, int64_t ndim) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  if (dim < -n || dim >= n) throw std::out_of_range("ref: dim out of range");
  return dim < 0 ? dim + n : dim;
}

Shape broadcast_shape(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n, 1);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i + a.size() >= n ? a[i + a.size() - n] : 1;
    const int64_t db = i + b.size() >= n ? b[i + b.size() - n] : 1;
    if (da != db && da != 1 && db != 1) throw std::invalid_argument("ref: not broadcastable");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

namespace {
// Advances a row-major multi-index; returns false after the last one.
bool next_index(std::vector<int64_t>& idx, const Shape& shape) {
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    if (++idx[d] < shape[d]) return true;
    idx[d] = 0;
  }
  return false;
}
}  // namespace

NdArray broadcast_to(const NdArray& a, const Shape& shape) {
  NdArray out = NdArray::zeros(shape);
  if (out.numel() == 0) return out;
  const size_t lead = shape.size() - a.shape.size();
  std::vector<int64_t> o(shape.size(), 0), src(a.shape.size(), 0);
  int64_t i = 0;
  do {
    for (size_t d = 0; d < a.shape.size(); ++d) src[d] = a.shape[d] == 1 ? 0 : o[lead + d];
    out.data[i++] = a.at(src);
  } while (next_index(o, shape));
  return out;
}

// ---- dtypes --------------------------------------------------------------------------------

double round_binary(double v, int precision, int emin, int emax) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0) return v;
  const double a = std::fabs(v);
  int e2 = 0;
  std::frexp(a, &e2);                    // a = m * 2^e2, m in [0.5, 1): the exponent of a is e2 - 1
  const int e = std::max(e2 - 1, emin);  // below the normal range the quantum stays fixed
  const double quantum = std::ldexp(1.0, e - (precision - 1));
  // a / quantum is exact (a power-of-two scaling); nearbyint rounds half to even.
  double r = std::nearbyint(a / quantum) * quantum;
  if (r >= std::ldexp(1.0, emax + 1)) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, v);
}

double round_to(double v, DType dt) {
  switch (dt) {
    case DType::f64:
      return v;
    case DType::f32:
      return round_binary(v, 24, -126, 127);
    case DType::f16:
      return round_binary(v, 11, -14, 15);
    case DType::bf16:
      return round_binary(v, 8, -126, 127);
    case DType::i32:
    case DType::i64:
      return std::trunc(v);
    case DType::b8:
      return v != 0.0 ? 1.0 : 0.0;
    case DType::u8:  // truncated, then modulo 256 (the cast's rule)
      return static_cast<double>(static_cast<uint8_t>(static_cast<int64_t>(v)));
  }
  return v;
}

NdArray round_to(const NdArray& a, DType dt) {
  NdArray out = a;
  for (double& v : out.data) v = round_to(v, dt);
  return out;
}

double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::f32:
      return std::ldexp(1.0, -24);
    case DType::f64:
      return std::ldexp(1.0, -53);
    case DType::f16:
      return std::ldexp(1.0, -11);
    case DType::bf16:
      return std::ldexp(1.0, -8);
    default:
      return 0.0;
  }
}

// ---- elementwise ---------------------------------------------------------------------------

NdArray map(const NdArray& a, const std::function<double(double)>& f) {
  NdArray out = a;
  for (double& v : out.data) v = f(v);
  return out;
}

NdArray zip(const NdArray& a, const NdArray& b, const std::function<double(double, double)>& f) {
  const Shape shape = broadcast_shape(a.shape, b.shape);
  const NdArray x = broadcast_to(a, shape), y = broadcast_to(b, shape);
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) out.data[i] = f(x.data[i], y.data[i]);
  return out;
}

NdArray where(const NdArray& cond, const NdArray& a, const NdArray& b) {
  const Shape shape = broadcast_shape(broadcast_shape(cond.shape, a.shape), b.shape);
  const NdArray c = broadcast_to(cond, shape), x = broadcast_to(a, shape),
                y = broadcast_to(b, shape);
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) out.data[i] = c.data[i] != 0 ? x.data[i] : y.data[i];
  return out;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double relu(double x) { return std::isnan(x) || x > 0 ? x : 0.0; }
double maximum(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return a > b ? a : b;
}
double minimum(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  return a < b ? a : b;
}

namespace {
constexpr double kPi = 3.141592653589793238462643383279502884;
constexpr double kGeluCubic = 0.044715;
}  // namespace

// Exact: x * Phi(x), Phi the standard normal CDF. Tanh approximation (Hendrycks & Gimpel):
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
double gelu(double x, bool approximate_tanh) {
  if (approximate_tanh) {
    const double z = std::sqrt(2.0 / kPi) * (x + kGeluCubic * x * x * x);
    return 0.5 * x * (1.0 + std::tanh(z));
  }
  return x * 0.5 * std::erfc(-x / std::sqrt(2.0));
}

// d/dx of the above, times grad.
double gelu_backward(double grad, double x, bool approximate_tanh) {
  if (approximate_tanh) {
    const double k = std::sqrt(2.0 / kPi);
    const double z = k * (x + kGeluCubic * x * x * x);
    const double t = std::tanh(z);
    const double dz = k * (1.0 + 3.0 * kGeluCubic * x * x);
    return grad * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dz);
  }
  const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0));
  const double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * kPi);
  return grad * (cdf + x * pdf);
}

double pow(double a, double b, DType dt) {
  if (is_floating(dt)) return std::pow(a, b);
  const int64_t base = static_cast<int64_t>(a), e = static_cast<int64_t>(b);
  // A negative power: 1 / base^-e truncated toward zero (0 for base 0, where there is no
  // value to truncate; Tessera defines it so on every device).
  if (e < 0) {
    if (base == 0) return 0.0;
    double r = 1.0;
    for (int64_t i = 0; i < -e; ++i) r *= static_cast<double>(base);
    return std::trunc(1.0 / r);
  }
  int64_t r = 1;
  for (int64_t i = 0; i < e; ++i) r *= base;
  return static_cast<double>(r);
}

// ---- reductions ----------------------------------------------------------------------------

namespace {

std::vector<bool> reduced_mask(const std::vector<int64_t>& dims, int64_t ndim) {
  std::vector<bool> mask(ndim, dims.empty());
  for (int64_t d : dims) {
    const int64_t k = wrap_dim(d, ndim);
    if (ndim > 0) mask[k] = true;
  }
  return mask;
}

// Applies f to the list of values of each output position (values in row-major order of
// the reduced dims), giving the output.
NdArray reduce(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim,
               const std::function<double(const std::vector<double>&)>& f) {
  const std::vector<bool> mask = reduced_mask(dims, x.ndim());
  Shape kept_shape;  // output shape with keepdim (reduced dims as 1)
  for (int64_t d = 0; d < x.ndim(); ++d) kept_shape.push_back(mask[d] ? 1 : x.shape[d]);
  std::vector<std::vector<double>> groups(static_cast<size_t>(count(kept_shape)));
  std::vector<int64_t> idx(x.ndim(), 0), kept(x.ndim(), 0);
  for (int64_t i = 0; i < x.numel(); ++i) {
    for (int64_t d = 0; d < x.ndim(); ++d) kept[d] = mask[d] ? 0 : idx[d];
    groups[ravel(kept, kept_shape)].push_back(x.data[i]);
    next_index(idx, x.shape);
  }
  NdArray out = NdArray::zeros(kept_shape);
  for (size_t g = 0; g < groups.size(); ++g) out.data[g] = f(groups[g]);
  if (!keepdim) {
    Shape s;
    for (int64_t d = 0; d < x.ndim(); ++d) {
      if (!mask[d]) s.push_back(x.shape[d]);
    }
    out.shape = s;
  }
  return out;
}

double plain_sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

}  // namespace

NdArray sum(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim, plain_sum);
}

NdArray mean(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim, [](const std::vector<double>& v) {
    return plain_sum(v) / static_cast<double>(v.size());
  });
}

NdArray max(const NdArray& x, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce(x, dims, keepdim, [](const std::vector<double>& v) {
    double m = -std::numeric_limits<double>::infinity();
    for (double a : v) m = maximum(m, a);
    return m;
  });
}

NdArray var(const NdArray& x, const std::vector<int64_t>& dims, int64_t correction, bool keepdim) {
  return reduce(x, dims, keepdim, [correction](const std::vector<double>& v) {
    const double n = static_cast<double>(v.size());
    if (n - static_cast<double>(correction) <= 0) return std::numeric_limits<double>::quiet_NaN();
    const double mu = plain_sum(v) / n;
    double ss = 0;
    for (double a : v) ss += (a - mu) * (a - mu);
    return ss / (n - static_cast<double>(correction));
  });
}

namespace {
double first_argmax(const std::vector<double>& v) {
  size_t best = 0;
  for (size_t i = 1; i < v.size() && !std::isnan(v[best]); ++i) {
    if (v[i] > v[best] || std::isnan(v[i])) best = i;
  }
  return static_cast<double>(best);
}
}  // namespace

NdArray argmax(const NdArray& x, int64_t dim, bool keepdim) {
  if (x.ndim() == 0) return NdArray::of({}, {0.0});
  return reduce(x, {wrap_dim(dim, x.ndim())}, keepdim, first_argmax);
}

NdArray argmax_all(const NdArray& x, bool keepdim) {
  NdArray out = NdArray::of({}, {first_argmax(x.data)});
  if (keepdim) out.shape = Shape(x.shape.size(), 1);
  return out;
}

}  // namespace tessera::ref
