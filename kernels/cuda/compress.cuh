// Launchers of 1-bit compression's bit packing on CUDA (compress.cu; the spec is
// kernels/cpu/compress.cc): bit j of byte k is the sign of element 8k + j (1: >= 0 or NaN).
//
//   launch_sign_pack(dev_tensor(bits), dev_tensor(x), stream);     // x contiguous, float
//   launch_sign_unpack(dev_tensor(out), dev_tensor(bits), stream); // out contiguous, float
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// bits: u8 [ceil(x.numel / 8)]; the last byte's bits past x.numel are 0.
void launch_sign_pack(const DevTensor& bits, const DevTensor& x, cudaStream_t stream);
// out[i] = bit i of bits ? +1 : -1, for i < out.numel.
void launch_sign_unpack(const DevTensor& out, const DevTensor& bits, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
