// Device code of conv2d that cuDNN does not provide: the bias add after the convolution.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// out [N, O, H, W] (contiguous) += bias [O] (contiguous, out's dtype), in f32 for 16-bit
// floats, f64 for f64.
void launch_conv_bias(const DevTensor& out, const DevTensor& bias, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
