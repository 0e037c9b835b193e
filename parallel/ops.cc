// The named sharded ops: thin wrappers over call() / factory() (dispatch.h).
#include "parallel/ops.h"

#include "tensor/error.h"
#include "tensor/op_attrs.h"
#include "tensor/random.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

ShardedTensor scalar(double v, const ShardedTensor& like) {
  return replicate(tessera::scalar_like(v, like.local(), "parallel scalar"), like.mesh_ptr());
}

}  // namespace

ShardedTensor gelu(const ShardedTensor& x, bool approximate_tanh) {
  return call1(OpId::gelu, {x}, op_attrs::gelu(approximate_tanh));
}
ShardedTensor pow(const ShardedTensor& a, double exponent) {
  return pow(a, scalar(exponent, a));
}
ShardedTensor where(const ShardedTensor& cond, const ShardedTensor& a, const ShardedTensor& b) {
  return call1(OpId::where, {cond, a, b});
}

ShardedTensor operator+(const ShardedTensor& a, const ShardedTensor& b) { return add(a, b); }
ShardedTensor operator-(const ShardedTensor& a, const ShardedTensor& b) { return sub(a, b); }
ShardedTensor operator*(const ShardedTensor& a, const ShardedTensor& b) { return mul(a, b); }
ShardedTensor operator/(const ShardedTensor& a, const ShardedTensor& b) { return div(a, b); }
ShardedTensor operator*(const ShardedTensor& a, double b) { return mul(a, scalar(b, a)); }
ShardedTensor operator+(const ShardedTensor& a, double b) { return add(a, scalar(b, a)); }

ShardedTensor sum(const ShardedTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return call1(OpId::sum, {x}, op_attrs::reduce(dims, keepdim));
}
ShardedTensor mean(const ShardedTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return call1(OpId::mean, {x}, op_attrs::reduce(dims, keepdim));
}
ShardedTensor max(const ShardedTensor& x, const std::vector<int64_t>& dims, bool keepdim) {
  return call1(OpId::max, {x}, op_attrs::reduce(dims, keepdim));
}
ShardedTensor var(const ShardedTensor& x, const std::vector<int64_t>& dims, int64_t correction,
                  bool keepdim) {
  return call1(OpId::var, {x}, op_attrs::var(dims, correction, keepdim));
}
ShardedTensor argmax(const ShardedTensor& x, int64_t dim, bool keepdim) {
  return call1(OpId::argmax, {x}, op_attrs::argmax(dim, keepdim));
}

ShardedTensor matmul(const ShardedTensor& a, const ShardedTensor& b) {
  TS_CHECK(a.dim() >= 2 && b.dim() >= 2,
           "parallel::matmul: operands must have rank >= 2, got {} and {} (unsqueeze 1-D "
           "operands)", shape_str(a.shape()), shape_str(b.shape()));
  return call1(OpId::matmul, {a, b});
}
ShardedTensor linear(const ShardedTensor& x, const ShardedTensor& weight, const ShardedTensor& bias,
                     Activation activation) {
  return call(OpId::linear, {x, weight, bias}, op_attrs::linear(activation))[0];
}
ShardedTensor softmax(const ShardedTensor& x, int64_t dim) {
  return call1(OpId::softmax, {x}, op_attrs::dim(dim));
}
ShardedTensor log_softmax(const ShardedTensor& x, int64_t dim) {
  return call1(OpId::log_softmax, {x}, op_attrs::dim(dim));
}
ShardedTensor layer_norm(const ShardedTensor& x, const Shape& normalized_shape,
                         const ShardedTensor& weight, const ShardedTensor& bias, double eps) {
  return call(OpId::layer_norm, {x, weight, bias},
              op_attrs::layer_norm(x.shape(), normalized_shape, eps))[0];
}
ShardedAddLayerNorm add_layer_norm(const ShardedTensor& x, const ShardedTensor& r,
                                   const Shape& normalized_shape, const ShardedTensor& weight,
                                   const ShardedTensor& bias, double eps) {
  if (!add_layer_norm_fuses(x.dtype(), r.dtype())) {  // autocast: as tensor/ops.cc
    const ShardedTensor s = x + r;
    return {s, layer_norm(s, normalized_shape, weight, bias, eps)};
  }
  const std::vector<ShardedTensor> out = call(OpId::add_layer_norm, {x, r, weight, bias},
                                              op_attrs::layer_norm(x.shape(), normalized_shape, eps));
  return {out[0], out[1]};
}
ShardedTensor cross_entropy(const ShardedTensor& logits, const ShardedTensor& target,
                            Reduction reduction, int64_t ignore_index) {
  return call(OpId::cross_entropy, {logits, target},
              op_attrs::cross_entropy(reduction, ignore_index))[0];
}
ShardedTensor dropout(const ShardedTensor& x, double p, bool training) {
  TS_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got {}", p);
  if (!training || p == 0.0) return x;
  // Every rank advances by the global count, so later draws stay in step across ranks; each
  // draws its block of the global mask (dispatch's local_attrs).
  const BatchSlice* slice = current_batch_slice();
  if (slice == nullptr) {
    return call1(OpId::dropout, {x}, op_attrs::dropout(p, default_generator(), x.numel()));
  }
  // Inside a batch slice the sharded tensor is rows [start, start + rows) of the global
  // batch: its mask is that block of the whole batch's (tensor/random.h).
  TS_CHECK(x.dim() >= 1 && x.shape()[0] == slice->rows,
           "dropout: inside a batch slice of {} rows (of {}), the input {} does not lead with "
           "the batch", slice->rows, slice->global_rows, x.str());
  Shape global = x.shape();
  global[0] = slice->global_rows;
  Attrs a = op_attrs::dropout(p, default_generator(), numel_of(global));
  std::vector<int64_t> starts(static_cast<size_t>(x.dim()), 0);
  starts[0] = slice->start;
  a.rng_view = RngView{global, starts};
  return call1(OpId::dropout, {x}, a);
}
ShardedTensor conv2d(const ShardedTensor& x, const ShardedTensor& weight, const ShardedTensor& bias,
                     std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  return call1(OpId::conv2d, {x, weight, bias}, op_attrs::conv2d(stride, padding));
}
ShardedTensor max_pool2d(const ShardedTensor& x, std::array<int64_t, 2> kernel_size,
                         std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  return call(OpId::max_pool2d, {x}, op_attrs::max_pool2d(kernel_size, stride, padding))[0];
}
ShardedTensor attention(const ShardedTensor& q, const ShardedTensor& k, const ShardedTensor& v,
                        bool causal, double scale) {
  return call(OpId::attention, {q, k, v}, op_attrs::attention(causal, scale))[0];
}
ShardedTensor attention_qkv(const ShardedTensor& qkv, int64_t head_dim, bool causal, double scale) {
  return call(OpId::attention_qkv, {qkv}, op_attrs::attention_qkv(head_dim, causal, scale))[0];
}
ShardedTensor embedding(const ShardedTensor& weight, const ShardedTensor& indices) {
  return call1(OpId::embedding, {weight, indices});
}
ShardedTensor index_select(const ShardedTensor& x, int64_t dim, const ShardedTensor& index) {
  return call1(OpId::index_select, {x, index}, op_attrs::dim(dim));
}
ShardedTensor index_add(const ShardedTensor& x, int64_t dim, const ShardedTensor& index,
                        const ShardedTensor& source) {
  return call1(OpId::index_add, {x, index, source}, op_attrs::dim(dim));
}
ShardedTensor gather(const ShardedTensor& x, int64_t dim, const ShardedTensor& index) {
  return call1(OpId::gather, {x, index}, op_attrs::dim(dim));
}
ShardedTensor scatter_add(const ShardedTensor& x, int64_t dim, const ShardedTensor& index,
                          const ShardedTensor& src) {
  return call1(OpId::scatter_add, {x, index, src}, op_attrs::dim(dim));
}
std::vector<ShardedTensor> topk(const ShardedTensor& x, int64_t k, int64_t dim) {
  return call(OpId::topk, {x}, op_attrs::topk(k, dim));
}
ShardedTensor cast(const ShardedTensor& x, DType dtype) {
  return call1(OpId::cast, {x}, op_attrs::cast(dtype));
}
ShardedTensor clone(const ShardedTensor& x) { return call1(OpId::clone, {x}); }

ShardedTensor view(const ShardedTensor& x, const Shape& shape) {
  return call1(OpId::view, {x}, op_attrs::shape(shape));
}
ShardedTensor permute(const ShardedTensor& x, const std::vector<int64_t>& order) {
  return call1(OpId::permute, {x}, op_attrs::dims(order));
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
  return call1(OpId::slice, {x}, op_attrs::slice(dim, start, end, step));
}
ShardedTensor expand(const ShardedTensor& x, const Shape& shape) {
  return call1(OpId::expand, {x}, op_attrs::shape(shape));
}
ShardedTensor squeeze(const ShardedTensor& x, const std::vector<int64_t>& dims) {
  return call1(OpId::squeeze, {x}, op_attrs::dims(dims));
}
ShardedTensor unsqueeze(const ShardedTensor& x, int64_t dim) {
  return call1(OpId::unsqueeze, {x}, op_attrs::dim(dim));
}
ShardedTensor cat(const std::vector<ShardedTensor>& tensors, int64_t dim) {
  TS_CHECK(!tensors.empty(), "cat: needs at least one tensor");
  return call1(OpId::cat, tensors, op_attrs::dim(dim));
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
  return factory(OpId::full, op_attrs::full(shape, value, dtype), mesh, placements);
}
ShardedTensor zeros(const Shape& shape, const MeshPtr& mesh, const Placements& placements, DType dtype) {
  return full(shape, 0.0, mesh, placements, dtype);
}
ShardedTensor ones(const Shape& shape, const MeshPtr& mesh, const Placements& placements, DType dtype) {
  return full(shape, 1.0, mesh, placements, dtype);
}
ShardedTensor randn(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                    uint64_t seed, uint64_t offset, DType dtype) {
  return factory(OpId::randn, op_attrs::random(shape, seed, offset, dtype), mesh, placements);
}
ShardedTensor rand(const Shape& shape, const MeshPtr& mesh, const Placements& placements,
                   uint64_t seed, uint64_t offset, DType dtype) {
  return factory(OpId::rand, op_attrs::random(shape, seed, offset, dtype), mesh, placements);
}
ShardedTensor arange(double start, double end, double step, const MeshPtr& mesh,
                     const Placements& placements, DType dtype) {
  return factory(OpId::arange, op_attrs::arange(start, end, step, dtype), mesh, placements);
}

}  // namespace tessera::parallel
