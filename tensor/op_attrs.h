// How each op's attributes are packed, once for every tensor type: the named wrappers of
// tensor/ops.h (Tensor) and parallel/ops.h (ShardedTensor) both build their Attrs here, so
// a new attribute or a check on one is written in one place.
//
//   return call1(OpId::softmax, {x}, op_attrs::softmax(dim));            // tensor/ops.cc
//   return parallel::call1(OpId::softmax, {x}, op_attrs::softmax(dim));  // parallel/ops.cc
//
// Checks that need only the attributes and the input shapes are made here too (layer_norm's
// normalized shape), naming the op as every other error does.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tensor/error.h"
#include "tensor/op.h"
#include "tensor/random.h"

namespace tessera::op_attrs {

inline Attrs gelu(bool approximate_tanh) {
  Attrs a;
  a.approximate_tanh = approximate_tanh;
  return a;
}
inline Attrs linear(Activation act) {
  Attrs a;
  a.activation = act;
  return a;
}
// sum, mean, max (dims empty: all).
inline Attrs reduce(const std::vector<int64_t>& dims, bool keepdim) {
  Attrs a;
  a.dims = dims;
  a.keepdim = keepdim;
  return a;
}
inline Attrs var(const std::vector<int64_t>& dims, int64_t correction, bool keepdim) {
  Attrs a = reduce(dims, keepdim);
  a.correction = correction;
  return a;
}
inline Attrs argmax(int64_t dim, bool keepdim) {
  Attrs a;
  a.dim = dim;
  a.keepdim = keepdim;
  return a;
}
inline Attrs argmax_all() {
  Attrs a;
  a.all_dims = true;
  return a;
}
// Every op that takes one dim: softmax, log_softmax, cat, unsqueeze, the index ops.
inline Attrs dim(int64_t d) {
  Attrs a;
  a.dim = d;
  return a;
}
inline Attrs topk(int64_t k, int64_t d) {
  Attrs a = dim(d);
  a.k = k;
  return a;
}
inline Attrs layer_norm(const Shape& x, const Shape& normalized_shape, double eps) {
  const int64_t nd = static_cast<int64_t>(normalized_shape.size());
  TS_CHECK(nd >= 1 && nd <= static_cast<int64_t>(x.size()) &&
               Shape(x.end() - nd, x.end()) == normalized_shape,
           "layer_norm: normalized shape {} must be a non-empty suffix of input shape {}",
           shape_str(normalized_shape), shape_str(x));
  Attrs a;
  a.normalized_ndim = nd;
  a.eps = eps;
  return a;
}
inline Attrs cross_entropy(Reduction reduction, int64_t ignore_index) {
  Attrs a;
  a.reduction = reduction;
  a.ignore_index = ignore_index;
  return a;
}
// The mask of element i is drawn at counter offset + i of the generator's stream; the
// generator advances by the (global) element count, so later draws stay in step. The
// wrappers check p first (also when not training, where this is never reached).
inline Attrs dropout(double p, Generator& gen, int64_t numel) {
  Attrs a;
  a.p = p;
  a.seed = gen.seed();
  a.offset = gen.advance(static_cast<uint64_t>(numel));
  return a;
}
inline Attrs scale(double s) {
  Attrs a;
  a.scale = s;
  return a;
}

inline Attrs attention(bool causal, double scale) {
  Attrs a;
  a.causal = causal;
  a.scale = scale;
  return a;
}
inline Attrs attention_qkv(int64_t head_dim, bool causal, double scale) {
  Attrs a = attention(causal, scale);
  a.head_dim = head_dim;
  return a;
}
inline Attrs conv2d(std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  Attrs a;
  a.stride = stride;
  a.padding = padding;
  return a;
}
// stride {0, 0}: the kernel size.
inline Attrs max_pool2d(std::array<int64_t, 2> kernel_size, std::array<int64_t, 2> stride,
                        std::array<int64_t, 2> padding) {
  Attrs a;
  a.kernel_size = kernel_size;
  a.stride = (stride[0] == 0 && stride[1] == 0) ? kernel_size : stride;
  a.padding = padding;
  return a;
}
inline Attrs cast(DType dtype) {
  Attrs a;
  a.dtype = dtype;
  return a;
}
// view and expand: the target shape.
inline Attrs shape(const Shape& s) {
  Attrs a;
  a.shape = s;
  return a;
}
// permute: the order; squeeze: the dims (empty: every size-1 dim).
inline Attrs dims(const std::vector<int64_t>& d) {
  Attrs a;
  a.dims = d;
  return a;
}
inline Attrs slice(int64_t d, int64_t start, int64_t end, int64_t step) {
  Attrs a = dim(d);
  a.start = start;
  a.end = end;
  a.step = step;
  return a;
}
inline Attrs full(const Shape& s, double value, DType dtype) {
  Attrs a = shape(s);
  a.value = value;
  a.dtype = dtype;
  return a;
}
// rand, randn at the generator state (seed, offset).
inline Attrs random(const Shape& s, uint64_t seed, uint64_t offset, DType dtype) {
  Attrs a = shape(s);
  a.seed = seed;
  a.offset = offset;
  a.dtype = dtype;
  return a;
}
inline Attrs arange(double start, double end, double step, DType dtype) {
  Attrs a;
  a.range_start = start;
  a.range_end = end;
  a.range_step = step;
  a.dtype = dtype;
  return a;
}

inline Attrs adamw(int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay) {
  Attrs a;
  a.step_count = step;
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.weight_decay = weight_decay;
  return a;
}
// adafactor_norm_ / adafactor_apply_ (tensor/ops.h): the update's form (product: (g a) b;
// else g rsqrt(max((a b) / divisor, floor))), and for apply the scale, the first moment's
// beta1 (0: none), the weight decay coefficient c and the final form (0 hf, 1 torch, 2 optax).
inline Attrs adafactor(bool product, double divisor, double floor, double scale = 1.0,
                       double beta1 = 0.0, double c = 0.0, int64_t form = 0) {
  Attrs a;
  a.k = product ? 1 : 0;
  a.value = divisor;
  a.eps = floor;
  a.scale = scale;
  a.beta1 = beta1;
  a.weight_decay = c;
  a.dim = form;
  return a;
}
inline Attrs sgd(int64_t step, double lr, double momentum, double dampening, double weight_decay,
                 bool nesterov) {
  Attrs a;
  a.step_count = step;
  a.lr = lr;
  a.momentum = momentum;
  a.dampening = dampening;
  a.weight_decay = weight_decay;
  a.nesterov = nesterov;
  return a;
}

}  // namespace tessera::op_attrs
