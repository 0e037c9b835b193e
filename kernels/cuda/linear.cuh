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

// v = acc [rows, n] + bias [n] (bias.data null: none); y = act(v) (act 0: v), and with an
// activation pre = v. acc is the GEMM's output: an f32 buffer for 16-bit y (v rounded once;
// the activation reads the rounded pre-activation and rounds again, as the CPU), else the
// output the pass rewrites (pre with an activation, y without).
void launch_bias_act(const DevTensor& acc, const DevTensor& pre, const DevTensor& y, const DevTensor& bias,
                     int64_t rows, int64_t n, int act, cudaStream_t stream);

// y [total] = act(pre [total]) (act != 0): the activation of the rounded pre-activation,
// computed in f32 for 16-bit values and rounded once, as launch_bias_act does it.
void launch_act(const DevTensor& pre, const DevTensor& y, int64_t total, int act, cudaStream_t stream);

// Bytes of workspace launch_linear_act_backward needs.
int64_t linear_act_backward_workspace_bytes(int64_t rows, int64_t n);
// dpre [rows, n] = g * act'(pre); db [n] = dpre's column sums (f64 partials over fixed row
// chunks, summed in chunk order: deterministic).
void launch_linear_act_backward(const DevTensor& dpre, const DevTensor& db, const DevTensor& g,
                                const DevTensor& pre, int64_t rows, int64_t n, int act,
                                void* workspace, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
