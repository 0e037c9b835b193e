// The named sharded ops: thin wrappers over call() / factory() (dispatch.cc).
#include "parallel/ops.h"

#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

ShardedTensor unary(OpId op, const ShardedTensor& x, const Attrs& a = {}) { return call1(op, {x}, a); }

ShardedTensor scalar(double v, const ShardedTensor& like) {
  return replicate(tessera::scalar_like(v, like.local(), "parallel scalar"), like.mesh_ptr());
}

Attrs reduce_attrs(const std::vector<int64_t>& dims, bool keepdim) {
  Attrs a;
  a.dims = dims;
  a.keepdim = keepdim;
  return a;
}

}  // namespace

ShardedTensor gelu(const ShardedTensor& x, bool approximate_tanh) {
  Attrs a;
  a.approximate_tanh = approximate_tanh;
  return unary(OpId::gelu, x, a);
}

ShardedTensor operator+(const ShardedTensor& a, const ShardedTensor& b) { return add(a, b); }
ShardedTensor operator-(const ShardedTensor& a, const ShardedTensor& b) { return sub(a, b); }
ShardedTensor operator*(const ShardedTensor& a, const ShardedTensor& b) { return mul(a, b); }
ShardedTensor operator/(const ShardedTensor& a, const ShardedTensor& b) { return div(a, b); }
ShardedTensor operator*(const ShardedTensor& a, double b) { return mul(a, scalar(b, a)); }
ShardedTensor operator+(const ShardedTensor& a, double b) { return add(a, scalar(b, a)); }

ShardedTensor sum(const ShardedTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return unary(OpId::sum, x, reduce_attrs(dims, keepdim));
}
ShardedTensor mean(const ShardedTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return unary(OpId::mean, x, reduce_attrs(dims, keepdim));
}
ShardedTensor max(const ShardedTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return unary(OpId::max, x, reduce_attrs(dims, keepdim));
}

ShardedTensor matmul(const ShardedTensor& a, const ShardedTensor& b) {
  TS_CHECK(a.dim() >= 2 && b.dim() >= 2,
           "parallel::matmul: operands must have rank >= 2, got {} and {} (unsqueeze 1-D "
           "operands)", shape_str(a.shape()), shape_str(b.shape()));
  return call1(OpId::matmul, {a, b});
}
ShardedTensor softmax(const ShardedTensor& x, int64_t dim) {
  Attrs a;
  a.dim = dim;
  return unary(OpId::softmax, x, a);
}
ShardedTensor log_softmax(const ShardedTensor& x, int64_t dim) {
  Attrs a;
  a.dim = dim;
  return unary(OpId::log_softmax, x, a);
}
ShardedTensor layer_norm(const ShardedTensor& x, const Shape& normalized_shape,
                         const ShardedTensor& weight, const ShardedTensor& bias, double eps) {
  Attrs a;
  a.eps = eps;
  a.normalized_ndim = static_cast<int64_t>(normalized_shape.size());
  TS_CHECK(x.dim() >= a.normalized_ndim &&
               Shape(x.shape().end() - a.normalized_ndim, x.shape().end()) == normalized_shape,
           "layer_norm: normalized shape {} is not the trailing shape of input {}",
           shape_str(normalized_shape), shape_str(x.shape()));
  return call(OpId::layer_norm, {x, weight, bias}, a)[0];
}
ShardedTensor cross_entropy(const ShardedTensor& logits, const ShardedTensor& target,
                            Reduction reduction, int64_t ignore_index) {
  Attrs a;
  a.reduction = reduction;
  a.ignore_index = ignore_index;
  return call(OpId::cross_entropy, {logits, target}, a)[0];
}
ShardedTensor dropout(const ShardedTensor& x, double p, bool training) {
  TS_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got {}", p);
  if (!training || p == 0.0) return x;
  Generator& gen = default_generator();
  Attrs a;
  a.p = p;
  a.seed = gen.seed();
  // Every rank advances by the global count, so later draws stay in step across ranks.
  a.offset = gen.advance(static_cast<uint64_t>(x.numel()));
  return unary(OpId::dropout, x, a);
}
ShardedTensor embedding(const ShardedTensor& weight, const ShardedTensor& indices) {
  return call1(OpId::embedding, {weight, indices});
}
ShardedTensor cast(const ShardedTensor& x, DType dtype) {
  Attrs a;
  a.dtype = dtype;
  return unary(OpId::cast, x, a);
}

ShardedTensor view(const ShardedTensor& x, const Shape& shape) {
  Attrs a;
  a.shape = shape;
  return unary(OpId::view, x, a);
}
ShardedTensor permute(const ShardedTensor& x, const std::vector<int64_t>& order) {
  Attrs a;
  a.dims = order;
  return unary(OpId::permute, x, a);
}
ShardedTensor transpose(const ShardedTensor& x, int64_t d0, int64_t d1) {
  const int64_t n = x.dim();
  d0 = normalize_dim("transpose", d0, n);
  d1 = normalize_dim("transpose", d1, n);
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::swap(order[d0], order[d1]);
  return permute(x, order);
}
ShardedTensor slice(const ShardedTensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  Attrs a;
  a.dim = dim;
  a.start = start;
  a.end = end;
  a.step = step;
  return unary(OpId::slice, x, a);
}
ShardedTensor expand(const ShardedTensor& x, const Shape& shape) {
  Attrs a;
  a.shape = shape;
  return unary(OpId::expand, x, a);
}
ShardedTensor squeeze(const ShardedTensor& x, const std::vector<int64_t>& dims) {
  Attrs a;
  a.dims = dims;
  return unary(OpId::squeeze, x, a);
}
ShardedTensor unsqueeze(const ShardedTensor& x, int64_t dim) {
  Attrs a;
  a.dim = dim;
  return unary(OpId::unsqueeze, x, a);
}
ShardedTensor cat(const std::vector<ShardedTensor>& tensors, int64_t dim) {
  Attrs a;
  a.dim = dim;
  return call1(OpId::cat, tensors, a);
}
ShardedTensor stack(const std::vector<ShardedTensor>& tensors, int64_t dim) {
  TS_CHECK(!tensors.empty(), "stack: needs at least one tensor");
  const int64_t d = normalize_dim("stack", dim, tensors[0].dim() + 1);
  std::vector<ShardedTensor> parts;
  for (const ShardedTensor& t : tensors) parts.push_back(unsqueeze(t, d));
  return cat(parts, d);
}
std::vector<ShardedTensor> split(const ShardedTensor& x, int64_t split_size, int64_t dim) {
  TS_CHECK(split_size > 0, "split: split_size must be positive, got {}", split_size);
  const int64_t d = normalize_dim("split", dim, x.dim());
  std::vector<ShardedTensor> out;
  for (int64_t s = 0; s < x.size(d) || (s == 0 && x.size(d) == 0); s += split_size) {
    out.push_back(slice(x, d, s, std::min(s + split_size, x.size(d))));
    if (x.size(d) == 0) break;
  }
  return out;
}

ShardedTensor full(const Shape& shape, double value, const MeshPtr& mesh, const Placements& placements,
                   DType dtype) {
  Attrs a;
  a.shape = shape;
  a.value = value;
  a.dtype = dtype;
  return factory(OpId::full, a, mesh, placements);
}
ShardedTensor zeros(const Shape& shape, const MeshPtr& mesh, const Placements& placements, DType dtype) {
  return full(shape, 0.0, mesh, placements, dtype);
}
ShardedTensor ones(const Shape& shape, const MeshPtr& mesh, const Placements& placements, DType dtype) {
  return full(shape, 1.0, mesh, placements, dtype);
}
namespace {
ShardedTensor random_factory(OpId op, const Shape& shape, const MeshPtr& mesh,
                             const Placements& placements, uint64_t seed, uint64_t offset, DType dtype) {
  Attrs a;
  a.shape = shape;
  a.seed = seed;
  a.offset = offset;
  a.dtype = dtype;
  return factory(op, a, mesh, placements);
}
}  // namespace

ShardedTensor randn(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                    uint64_t seed, uint64_t offset, DType dtype) {
  return random_factory(OpId::randn, shape, mesh, placements, seed, offset, dtype);
}
ShardedTensor rand(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                   uint64_t seed, uint64_t offset, DType dtype) {
  return random_factory(OpId::rand, shape, mesh, placements, seed, offset, dtype);
}
ShardedTensor arange(double start, double end, double step, const MeshPtr& mesh,
                     const Placements& placements, DType dtype) {
  Attrs a;
  a.range_start = start;
  a.range_end = end;
  a.range_step = step;
  a.dtype = dtype;
  return factory(OpId::arange, a, mesh, placements);
}

}  // namespace tessera::parallel
