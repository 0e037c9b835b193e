// Device-side copies (with casts) and fills.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// dst <- src elementwise (src already broadcast to dst's shape), converting dtypes as the
// CPU's copy does. Contiguous same-dtype copies are one cudaMemcpyAsync.
void launch_copy(const DevTensor& dst, const DevTensor& src, cudaStream_t stream);

// Writes the element whose bytes are `bits` (dtype-sized, little end) to every element of a
// contiguous dst.
void launch_fill(const DevTensor& dst, uint64_t bits, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
