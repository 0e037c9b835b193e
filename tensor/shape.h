// Shapes and strides (in elements), broadcasting and dim helpers shared by every layer.
//
//   Shape s = broadcast_shapes("add", {2, 1, 4}, {3, 1});   // {2, 3, 4}
//   Strides st = contiguous_strides(s);                      // {12, 4, 1}
//   int64_t d = normalize_dim("softmax", -1, 3);              // 2
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/ranges.h>

namespace tessera {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

// Both throw Error when the product overflows int64 (a shape from a file or a flag can ask
// for 2^62 x 2^62 elements; nothing may wrap around silently).
int64_t numel_of(const Shape& shape);
Strides contiguous_strides(const Shape& shape);
// The bytes of a contiguous tensor of `shape` with `itemsize`-byte elements: Error naming `op`
// on a negative dim, or when the element count, the strides or the bytes overflow int64.
int64_t storage_bytes(std::string_view op, const Shape& shape, int64_t itemsize);
std::string shape_str(const Shape& shape);  // "[2, 3]"

// NumPy broadcasting; throws Error naming `op` and both shapes when incompatible.
Shape broadcast_shapes(std::string_view op, const Shape& a, const Shape& b);

// Wraps a possibly negative dim into [0, ndim); throws Error naming `op` when out of range.
int64_t normalize_dim(std::string_view op, int64_t dim, int64_t ndim);

// Normalizes, sorts and de-duplicates a dim list; an empty list means every dim.
std::vector<int64_t> normalize_dims(std::string_view op, const std::vector<int64_t>& dims,
                                    int64_t ndim);

// Strides of `shape` viewing an operand of `from_shape`/`from_strides` broadcast to `shape`
// (0 stride on broadcast dims). Requires from_shape to be broadcastable to shape.
Strides broadcast_strides(const Shape& from_shape, const Strides& from_strides,
                          const Shape& shape);

// When a view of `shape`/`strides` fills its span densely in some order of its dims but not
// in its own (a transposed or permuted contiguous block): that order, the dims by decreasing
// stride with size-1 dims (any stride) left in place, so that permuting the view by it gives
// a contiguous one. Empty otherwise: already contiguous, fewer than 2 dims, gaps or overlaps.
std::vector<int64_t> dense_order(const Shape& shape, const Strides& strides);

}  // namespace tessera
