// The f64 reference: indexing, joining, views, factories and the Philox streams.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "tests/reference/reference.h"

namespace tessera::ref {

namespace {
int64_t checked_index(double v, int64_t size) {
  const int64_t i = static_cast<int64_t>(v);
  if (i < 0 || i >= size) throw std::out_of_range("ref: index out of range");
  return i;
}
}  // namespace

NdArray embedding(const NdArray& weight, const NdArray& indices) {
  const int64_t V = weight.shape[0], D = weight.shape[1];
  Shape shape = indices.shape;
  shape.push_back(D);
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < indices.numel(); ++i) {
    const int64_t row = checked_index(indices.data[i], V);
    for (int64_t d = 0; d < D; ++d) out.data[i * D + d] = weight.data[row * D + d];
  }
  return out;
}

// out[..., i, ...] = x[..., index[i], ...] along dim.
NdArray index_select(const NdArray& x, int64_t dim, const NdArray& index) {
  const int64_t d = wrap_dim(dim, x.ndim());
  Shape shape = x.shape;
  shape[d] = index.numel();
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, shape);
    idx[d] = checked_index(index.data[idx[d]], x.shape[d]);
    out.data[i] = x.at(idx);
  }
  return out;
}

// out = x; out[..., index[i], ...] += source[..., i, ...], in order of i.
NdArray index_add(const NdArray& x, int64_t dim, const NdArray& index, const NdArray& source) {
  const int64_t d = wrap_dim(dim, x.ndim());
  NdArray out = x;
  for (int64_t i = 0; i < source.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, source.shape);
    idx[d] = checked_index(index.data[idx[d]], x.shape[d]);
    out.at(idx) += source.data[i];
  }
  return out;
}

// out[i0, .., ik, ..] = x[i0, .., index[i0, .., ik, ..], ..] with the index replacing dim.
NdArray gather(const NdArray& x, int64_t dim, const NdArray& index) {
  const int64_t d = wrap_dim(dim, x.ndim());
  NdArray out = NdArray::zeros(index.shape);
  for (int64_t i = 0; i < index.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, index.shape);
    idx[d] = checked_index(index.data[i], x.shape[d]);
    out.data[i] = x.at(idx);
  }
  return out;
}

// out = x; out[.., index[p], ..] += src[p] for every position p of index (dim replaced).
NdArray scatter_add(const NdArray& x, int64_t dim, const NdArray& index, const NdArray& src) {
  const int64_t d = wrap_dim(dim, x.ndim());
  NdArray out = x;
  for (int64_t i = 0; i < index.numel(); ++i) {
    const std::vector<int64_t> pos = unravel(i, index.shape);
    std::vector<int64_t> dst = pos;
    dst[d] = checked_index(index.data[i], x.shape[d]);
    out.at(dst) += src.at(pos);
  }
  return out;
}

NdArray cat(const std::vector<NdArray>& xs, int64_t dim) {
  const int64_t d = wrap_dim(dim, xs.at(0).ndim());
  Shape shape = xs[0].shape;
  shape[d] = 0;
  for (const NdArray& x : xs) shape[d] += x.shape[d];
  NdArray out = NdArray::zeros(shape);
  int64_t start = 0;
  for (const NdArray& x : xs) {
    for (int64_t i = 0; i < x.numel(); ++i) {
      std::vector<int64_t> idx = unravel(i, x.shape);
      idx[d] += start;
      out.at(idx) = x.data[i];
    }
    start += x.shape[d];
  }
  return out;
}

NdArray stack(const std::vector<NdArray>& xs, int64_t dim) {
  std::vector<NdArray> parts;
  for (const NdArray& x : xs) parts.push_back(unsqueeze(x, dim));
  return cat(parts, wrap_dim(dim, xs.at(0).ndim() + 1));
}

std::vector<NdArray> split(const NdArray& x, const std::vector<int64_t>& sizes, int64_t dim) {
  const int64_t d = wrap_dim(dim, x.ndim());
  std::vector<NdArray> out;
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(slice(x, d, start, start + s, 1));
    start += s;
  }
  return out;
}

NdArray reshape(const NdArray& x, const Shape& shape) {
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1)
      infer = static_cast<int64_t>(i);
    else
      known *= s[i];
  }
  if (infer >= 0) s[infer] = known == 0 ? 0 : x.numel() / known;
  if (count(s) != x.numel()) throw std::invalid_argument("ref::reshape: element count");
  return NdArray::of(s, x.data);
}

NdArray permute(const NdArray& x, const std::vector<int64_t>& order) {
  Shape shape(order.size());
  for (size_t i = 0; i < order.size(); ++i) shape[i] = x.shape[wrap_dim(order[i], x.ndim())];
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) {
    const std::vector<int64_t> o = unravel(i, shape);
    std::vector<int64_t> src(x.shape.size());
    for (size_t k = 0; k < order.size(); ++k) src[wrap_dim(order[k], x.ndim())] = o[k];
    out.data[i] = x.at(src);
  }
  return out;
}

NdArray slice(const NdArray& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  const int64_t d = wrap_dim(dim, x.ndim());
  const int64_t size = x.shape[d];
  auto clamp = [size](int64_t i) { return std::clamp<int64_t>(i < 0 ? i + size : i, 0, size); };
  std::vector<int64_t> picked;
  for (int64_t i = clamp(start); i < clamp(end); i += step) picked.push_back(i);
  Shape shape = x.shape;
  shape[d] = static_cast<int64_t>(picked.size());
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) {
    std::vector<int64_t> idx = unravel(i, shape);
    idx[d] = picked[idx[d]];
    out.data[i] = x.at(idx);
  }
  return out;
}

NdArray expand(const NdArray& x, const Shape& shape) {
  Shape s = shape;
  const size_t lead = s.size() - x.shape.size();
  for (size_t i = lead; i < s.size(); ++i) {
    if (s[i] == -1) s[i] = x.shape[i - lead];
  }
  return broadcast_to(x, s);
}

NdArray squeeze(const NdArray& x, const std::vector<int64_t>& dims) {
  std::vector<bool> drop(x.shape.size(), false);
  for (size_t i = 0; i < x.shape.size(); ++i) drop[i] = dims.empty() && x.shape[i] == 1;
  for (int64_t d : dims) {
    const int64_t k = wrap_dim(d, x.ndim());
    if (x.ndim() > 0 && x.shape[k] == 1) drop[k] = true;
  }
  Shape shape;
  for (size_t i = 0; i < x.shape.size(); ++i) {
    if (!drop[i]) shape.push_back(x.shape[i]);
  }
  return NdArray::of(shape, x.data);
}

NdArray unsqueeze(const NdArray& x, int64_t dim) {
  Shape shape = x.shape;
  shape.insert(shape.begin() + wrap_dim(dim, x.ndim() + 1), 1);
  return NdArray::of(shape, x.data);
}

// ---- factories -----------------------------------------------------------------------------

NdArray full(const Shape& shape, double value, DType dt) {
  return NdArray::zeros(shape, round_to(value, dt));
}

NdArray arange(double start, double end, double step, DType dt) {
  const double n = std::ceil((end - start) / step);
  const int64_t len = n > 0 ? static_cast<int64_t>(n) : 0;
  NdArray out = NdArray::zeros({len});
  for (int64_t i = 0; i < len; ++i)
    out.data[i] = round_to(start + step * static_cast<double>(i), dt);
  return out;
}

// ---- Philox ----------------------------------------------------------------------------------

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  // One round: two 32x32 -> 64-bit products, their halves mixed with the other words and
  // the key; the key is bumped by the Weyl constants between rounds.
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{M0} * ctr[0];
    const uint64_t p1 = uint64_t{M1} * ctr[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
    key = {key[0] + W0, key[1] + W1};
  }
  return ctr;
}

namespace {

std::array<uint32_t, 4> words(uint64_t seed, uint64_t counter) {
  return philox4x32_10({static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0, 0},
                       {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
}

uint64_t top53(uint32_t hi, uint32_t lo) { return ((uint64_t{hi} << 32) | lo) >> 11; }

// The global counter of local element i of a block.
uint64_t counter_of(int64_t i, const Shape& shape, uint64_t offset, const Shape& global_shape,
                    const std::vector<int64_t>& starts) {
  if (global_shape.empty()) return offset + static_cast<uint64_t>(i);
  std::vector<int64_t> idx = unravel(i, shape);
  for (size_t d = 0; d < idx.size(); ++d) idx[d] += starts[d];
  return offset + static_cast<uint64_t>(ravel(idx, global_shape));
}

}  // namespace

double uniform01(uint64_t seed, uint64_t counter, DType dt) {
  const std::array<uint32_t, 4> w = words(seed, counter);
  if (dt == DType::f64) return std::ldexp(static_cast<double>(top53(w[0], w[1])), -53);
  const double u = round_to(std::ldexp(static_cast<double>(w[0] >> 8), -24), dt);
  if (u < 1.0) return u;
  const int precision = dt == DType::f16 ? 11 : dt == DType::bf16 ? 8 : 24;
  return 1.0 - std::ldexp(1.0, -precision);  // the largest value below 1
}

double standard_normal(uint64_t seed, uint64_t counter, DType dt) {
  const std::array<uint32_t, 4> w = words(seed, counter);
  const double u1 = std::ldexp(static_cast<double>(top53(w[0], w[1]) + 1), -53);
  const double u2 = std::ldexp(static_cast<double>(top53(w[2], w[3])), -53);
  const double two_pi = 6.283185307179586476925286766559;
  return round_to(std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2), dt);
}

NdArray rand(const Shape& shape, uint64_t seed, uint64_t offset, DType dt,
             const Shape& global_shape, const std::vector<int64_t>& starts) {
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) {
    out.data[i] = uniform01(seed, counter_of(i, shape, offset, global_shape, starts), dt);
  }
  return out;
}

NdArray randn(const Shape& shape, uint64_t seed, uint64_t offset, DType dt,
              const Shape& global_shape, const std::vector<int64_t>& starts) {
  NdArray out = NdArray::zeros(shape);
  for (int64_t i = 0; i < out.numel(); ++i) {
    out.data[i] = standard_normal(seed, counter_of(i, shape, offset, global_shape, starts), dt);
  }
  return out;
}

NdArray dropout(const NdArray& x, double p, uint64_t seed, uint64_t offset,
                const Shape& global_shape, const std::vector<int64_t>& starts) {
  NdArray out = x;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const uint64_t counter = counter_of(i, x.shape, offset, global_shape, starts);
    const bool keep = uniform01(seed, counter, DType::f32) >= p;
    out.data[i] = keep ? x.data[i] / (1.0 - p) : 0.0;
  }
  return out;
}

}  // namespace tessera::ref
