// Launchers of the fused causal attention op on CUDA (flash-attention style: the [T, T]
// probabilities are never stored; the backward recomputes them from the saved row
// logsumexp). attention.cu holds the dispatch, the backward's D = rowsum(dO * O) pass and
// the SIMT kernels (f32, f64, and 16-bit shapes the tensor-core path does not take);
// attention_flash.cu the tensor-core kernels (f16/bf16, head dim 32/64/128).
//
//   launch_attention_forward(q, k, v, out, lse, scale, causal, stream);
//   launch_attention_backward(grad, q, k, v, out, lse, delta, dq, dk, dv, scale, causal, stream);
//
// Operands, out, dq, dk and dv are [B, H, T, D] with unit stride over D (other strides
// free); lse and delta ([B, H, T], lse's dtype) are contiguous. lse is f32 (f64 for f64
// inputs).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

void launch_attention_forward(DevTensor q, DevTensor k, DevTensor v, DevTensor out,
                              DevTensor lse, double scale, bool causal, cudaStream_t stream);

void launch_attention_backward(DevTensor grad, DevTensor q, DevTensor k, DevTensor v,
                               DevTensor out, DevTensor lse, DevTensor delta, DevTensor dq,
                               DevTensor dk, DevTensor dv, double scale, bool causal,
                               cudaStream_t stream);

// ---- between attention.cu and attention_flash.cu ------------------------------------------
// One operand: element (b, h, t, d) at data + b * sb + h * sh + t * st + d (elements).
struct AttnOperand {
  void* data = nullptr;
  int64_t sb = 0, sh = 0, st = 0;
};

struct AttnArgs {
  int B = 0, H = 0, T = 0, D = 0;
  bool causal = false;
  double scale = 1.0;
  AttnOperand q, k, v, o, dout;  // inputs (o, dout: backward only)
  AttnOperand out, dq, dk, dv;   // outputs (unit stride over D)
  void* lse = nullptr;           // [B, H, T]: written by the forward, read by the backward
  void* delta = nullptr;         // [B, H, T]: rowsum(dO * O), backward scratch
};

// The tensor-core kernels. Return false (launching nothing) when they do not apply: dtype
// not f16/bf16, D not 32/64/128, or strides/pointers not 16-byte aligned.
bool flash_forward(const AttnArgs& a, int dtype, cudaStream_t stream);
// Expects a.delta already computed.
bool flash_backward(const AttnArgs& a, int dtype, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
