// Small helpers for CPU kernels (no dispatcher, no autograd: kernels call each other's
// loops directly).
#pragma once

#include <vector>

#include "tensor/tensor.h"

namespace tessera::cpu {

// `t` itself when contiguous, else a contiguous copy made by the copy loop.
Tensor contiguous_cpu(const Tensor& t);

// Copies src (broadcast to dst's shape, any dtype) into dst (any strides, any dtype).
void copy_cpu(const Tensor& dst, const Tensor& src);

// The storage offset (from the tensor's own offset) of linear index `i` in row-major order
// over `shape` with `strides`.
inline int64_t offset_of(int64_t i, const Shape& shape, const Strides& strides) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    off += (i % shape[d]) * strides[d];
    i /= shape[d];
  }
  return off;
}

// A contiguous tensor viewed as [outer, size(dim), inner].
struct Split3 {
  int64_t outer = 1, mid = 1, inner = 1;
};
inline Split3 split3(const Shape& s, int64_t dim) {
  Split3 r;
  for (int64_t i = 0; i < dim; ++i) r.outer *= s[i];
  r.mid = s[dim];
  for (size_t i = dim + 1; i < s.size(); ++i) r.inner *= s[i];
  return r;
}

// The first row of each group of a grouped matmul and, last, `rows`: the integer group
// sizes (any device) checked non-negative and summing to `rows` (tessera::Error naming `op`).
// Shared by the CPU and CUDA kernels (kernels/cpu/matmul.cc defines it).
std::vector<int64_t> group_starts(const char* op, const Tensor& sizes, int64_t rows);

// The row stride of x [..., K] seen as a [rows, K] matrix, or false when its leading dims do
// not collapse to one stride (then a kernel copies it). Shared by linear's CPU and CUDA
// kernels (kernels/cpu/linear.cc defines it).
bool row_stride_of(const Tensor& x, int64_t& stride);

// x [..., B, T, C] (contiguous) -> its heads [B, C / head_dim, T, head_dim] as a view: how
// attention_qkv's CPU and CUDA kernels see the packed operands (kernels/cpu/attention.cc
// defines it; call it under NoGradGuard, the operands may require grad).
Tensor attention_heads(const Tensor& x, int64_t head_dim);
// Part i (q, k or v) of a packed [3, B, T, C] tensor as heads.
inline Tensor attention_heads(const Tensor& packed, int64_t i, int64_t head_dim) {
  return attention_heads(packed.select(0, i), head_dim);
}

// n contiguous 16-bit floats widened to f32, and f32 values rounded to f16/bf16, with the bits
// of Half's and BFloat16's own conversions (tensor/dtype.h); f16 moves 8 values per F16C
// instruction (a group holding a NaN takes the scalar conversion, which keeps NaN bits).
void widen_run(const Half* src, float* dst, int64_t n);
void widen_run(const BFloat16* src, float* dst, int64_t n);
void narrow_run(const float* src, Half* dst, int64_t n);
void narrow_run(const float* src, BFloat16* dst, int64_t n);

// A contiguous f32 copy of a 16-bit float tensor (f32/f64 tensors are returned contiguous).
Tensor to_compute_cpu(const Tensor& t);
// The same for a kernel that reads any strides (matmul): a 16-bit tensor that fills its span
// densely in some order of its dims (a transposed or permuted contiguous one, as a weight
// gradient's x^T is) is widened in that memory order and keeps its layout, so the widening
// reads and writes memory in order instead of gathering across rows; other 16-bit layouts
// come out contiguous. f32/f64 tensors are returned as they are.
Tensor to_compute_any_layout_cpu(const Tensor& t);

}  // namespace tessera::cpu
