// Launchers of the CUDA elementwise kernels (elementwise.cu): unary ops, binary ops with
// NumPy broadcasting, comparisons, where and gelu_backward.
//
//   EwOperand a = ..., b = ...;      // device tensors broadcast to out, or host scalars
//   launch_binary(BinaryOp::add, dev_tensor(out), a, b, stream);
//
// `out` is contiguous (call() allocates it so). Operands are device tensors already broadcast
// to out's shape (dev_tensor_broadcast), or 0-d CPU tensors whose element travels by value in
// the kernel's arguments (`bits`, dtype-sized, little end), as PyTorch's CPU scalars do.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

enum class UnaryOp : int { neg, exp, log, sqrt, rsqrt, abs, tanh, sigmoid, relu, gelu, gelu_tanh };

enum class BinaryOp : int {
  add, sub, mul, div, pow, maximum, minimum,  // out dtype = input dtype
  eq, ne, lt, le, gt, ge,                     // out b8
  gelu_backward, gelu_tanh_backward,          // (grad, x), floats only
};

// How an operand is read. kEwDeviceScalar: a one-element device tensor, read once per thread.
enum EwMode : int { kEwTensor = 0, kEwHostScalar = 1, kEwDeviceScalar = 2 };

struct EwOperand {
  DevTensor t;  // broadcast to out's shape; only t.dtype matters for a host scalar
  int mode = kEwTensor;
  uint64_t bits = 0;  // the host scalar's element
};

void launch_unary(UnaryOp op, const DevTensor& out, const EwOperand& x, cudaStream_t stream);
void launch_binary(BinaryOp op, const DevTensor& out, const EwOperand& a, const EwOperand& b,
                   cudaStream_t stream);
// out = cond ? a : b (cond b8; a, b and out one dtype).
void launch_where(const DevTensor& out, const EwOperand& cond, const EwOperand& a,
                  const EwOperand& b, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
