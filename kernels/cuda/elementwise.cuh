// Launchers of the CUDA elementwise kernels (elementwise.cu): the functor family ops of the
// op list (unary, binary with NumPy broadcasting, comparisons), gelu, gelu_backward, where.
//
//   EwOperand a = ..., b = ...;      // device tensors broadcast to out, or host scalars
//   launch_binary(OpId::add, dev_tensor(out), a, b, stream);
//
// `out` is contiguous (call() allocates it so). Operands are device tensors already broadcast
// to out's shape (dev_tensor_broadcast), or 0-d CPU tensors whose element travels by value in
// the kernel's arguments (`bits`, dtype-sized, little end), as PyTorch's CPU scalars do.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"
#include "tensor/op_list.h"

namespace tessera::cuda_kernels {

// How an operand is read. kEwDeviceScalar: a one-element device tensor, read once per thread.
enum EwMode : int { kEwTensor = 0, kEwHostScalar = 1, kEwDeviceScalar = 2 };

struct EwOperand {
  DevTensor t;  // broadcast to out's shape; only t.dtype matters for a host scalar
  int mode = kEwTensor;
  uint64_t bits = 0;  // the host scalar's element
};

// `op` is a member of TS_UNARY_OPS (launch_unary) or of TS_BINARY_OPS / TS_COMPARE_OPS
// (launch_binary); the scalar functor of the same name in kernels/scalar_ops.h runs.
void launch_unary(OpId op, const DevTensor& out, const EwOperand& x, cudaStream_t stream);
void launch_binary(OpId op, const DevTensor& out, const EwOperand& a, const EwOperand& b,
                   cudaStream_t stream);
void launch_gelu(bool approximate_tanh, const DevTensor& out, const EwOperand& x,
                 cudaStream_t stream);
// d gelu(x) * grad.
void launch_gelu_backward(bool approximate_tanh, const DevTensor& out, const EwOperand& grad,
                          const EwOperand& x, cudaStream_t stream);
// out = cond ? a : b (cond b8; a, b and out one dtype).
void launch_where(const DevTensor& out, const EwOperand& cond, const EwOperand& a,
                  const EwOperand& b, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
