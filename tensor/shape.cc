#include "tensor/shape.h"

#include <algorithm>

#include "tensor/error.h"

namespace tessera {

namespace {

// The element count of `shape` into *n; false when it overflows int64 (a zero dim makes it
// 0, however large the other dims).
bool count_elements(const Shape& shape, int64_t* n) {
  *n = 1;
  bool overflow = false;
  for (int64_t s : shape) {
    if (s == 0) {
      *n = 0;
      return true;
    }
    overflow |= __builtin_mul_overflow(*n, s, n);
  }
  return !overflow;
}

}  // namespace

int64_t numel_of(const Shape& shape) {
  int64_t n = 0;
  if (!count_elements(shape, &n)) [[unlikely]] {
    fail("shape {} has more elements than an int64 counts (2^63 - 1)", shape_str(shape));
  }
  return n;
}

Strides contiguous_strides(const Shape& shape) {
  Strides strides(shape.size());
  int64_t s = 1;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    // A zero dim leaves the other dims' strides as if it were 1, so they can still wrap.
    if (__builtin_mul_overflow(s, std::max<int64_t>(shape[i], 1), &s) && i > 0) [[unlikely]] {
      fail("shape {}: the contiguous strides overflow int64 (the product of the dims other "
           "than the first, zero dims counted as 1, must be below 2^63)",
           shape_str(shape));
    }
  }
  return strides;
}

int64_t storage_bytes(std::string_view op, const Shape& shape, int64_t itemsize) {
  for (int64_t s : shape) {
    TS_CHECK(s >= 0, "{}: negative size in shape {}", op, shape_str(shape));
  }
  int64_t span = 1;  // the product contiguous_strides needs, zero dims counted as 1
  for (size_t i = 1; i < shape.size(); ++i) {
    TS_CHECK(!__builtin_mul_overflow(span, std::max<int64_t>(shape[i], 1), &span),
             "{}: shape {} is too large: its strides overflow int64", op, shape_str(shape));
  }
  int64_t numel = 0, bytes = 0;
  TS_CHECK(count_elements(shape, &numel),
           "{}: shape {} has more elements than an int64 counts (2^63 - 1)", op, shape_str(shape));
  TS_CHECK(!__builtin_mul_overflow(numel, itemsize, &bytes),
           "{}: shape {} of {}-byte elements needs {} x {} bytes, more than an int64 counts", op,
           shape_str(shape), itemsize, numel, itemsize);
  return bytes;
}

std::string shape_str(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

Shape broadcast_shapes(std::string_view op, const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da == db || db == 1) {
      out[i] = da;
    } else if (da == 1) {
      out[i] = db;
    } else {
      fail("{}: shapes {} and {} are not broadcastable (dim {}: {} vs {})", op, shape_str(a),
           shape_str(b), i, da, db);
    }
  }
  return out;
}

int64_t normalize_dim(std::string_view op, int64_t dim, int64_t ndim) {
  const int64_t lo = ndim == 0 ? -1 : -ndim;
  const int64_t hi = ndim == 0 ? 0 : ndim - 1;
  if (dim < lo || dim > hi) {
    fail("{}: dim {} out of range for a {}-d tensor (expected {} to {})", op, dim, ndim, lo, hi);
  }
  if (dim < 0) dim += std::max<int64_t>(ndim, 1);
  return dim;
}

std::vector<int64_t> normalize_dims(std::string_view op, const std::vector<int64_t>& dims,
                                    int64_t ndim) {
  std::vector<int64_t> out;
  if (dims.empty()) {
    for (int64_t i = 0; i < ndim; ++i) out.push_back(i);
    return out;
  }
  for (int64_t d : dims) out.push_back(normalize_dim(op, d, ndim));
  if (ndim == 0) return {};  // dim 0 / -1 of a 0-d tensor: nothing to reduce over
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end()) {
    fail("{}: dim list [{}] repeats a dim", op, fmt::join(dims, ", "));
  }
  return out;
}

std::vector<int64_t> dense_order(const Shape& shape, const Strides& strides) {
  const int64_t n = static_cast<int64_t>(shape.size());
  std::vector<int64_t> order;  // the dims of size > 1
  for (int64_t d = 0; d < n; ++d) {
    if (shape[d] != 1) order.push_back(d);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return strides[x] > strides[y]; });
  int64_t expected = 1;
  bool in_place = true;  // the order is the dims' own: contiguous already
  for (size_t i = order.size(); i-- > 0;) {
    if (strides[order[i]] != expected) return {};
    expected *= shape[order[i]];
    in_place = in_place && (i == 0 || order[i - 1] < order[i]);
  }
  if (n < 2 || in_place) return {};
  std::vector<int64_t> full(static_cast<size_t>(n));
  size_t next = 0;
  for (int64_t d = 0; d < n; ++d) full[d] = shape[d] == 1 ? d : order[next++];
  return full;
}

Strides broadcast_strides(const Shape& from_shape, const Strides& from_strides,
                          const Shape& shape) {
  Strides out(shape.size(), 0);
  const size_t lead = shape.size() - from_shape.size();
  for (size_t i = 0; i < from_shape.size(); ++i) {
    out[lead + i] = (from_shape[i] == 1 && shape[lead + i] != 1) ? 0 : from_strides[i];
  }
  return out;
}

}  // namespace tessera
