// Launchers of linear's work around its GEMM on CUDA (the GEMM itself is cuBLASLt's, in
// matmul.cc): the bias and activation pass, and linear_act_backward. Tensors are
// contiguous [rows, n] (the host glue makes them so). act uses Activation's numbering
// (0 none, 1 relu, 2 gelu, 3 gelu_tanh); the activations are kernels/scalar_ops.h's functors,
// as on the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// c [rows, n] += bias [n] (bias.data null: none); then, with act != 0, y = act(c). 16-bit c
// holds the GEMM's rounded product; c + bias is computed in f32 and rounded once for c and
// once (after the activation) for y.
void launch_bias_act(const DevTensor& c, const DevTensor& y, const DevTensor& bias, int64_t rows,
                     int64_t n, int act, cudaStream_t stream);

// Bytes of workspace launch_linear_act_backward needs.
int64_t linear_act_backward_workspace_bytes(int64_t rows, int64_t n);
// dpre [rows, n] = g * act'(pre); db [n] = dpre's column sums (f64 partials over fixed row
// chunks, summed in chunk order: deterministic).
void launch_linear_act_backward(const DevTensor& dpre, const DevTensor& db, const DevTensor& g,
                                const DevTensor& pre, int64_t rows, int64_t n, int act,
                                void* workspace, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
