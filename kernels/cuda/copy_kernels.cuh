// Device-side copies (with casts) and fills.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// dst <- src elementwise (src already broadcast to dst's shape), converting dtypes as the
// CPU's copy does, on the path plan_copy (strided_index.h) chooses: contiguous same-dtype
// copies are one cudaMemcpyAsync.
void launch_copy(const DevTensor& dst, const DevTensor& src, cudaStream_t stream);

// Writes the element whose bytes are `bits` (dtype-sized, little end) to every element of a
// contiguous dst.
void launch_fill(const DevTensor& dst, uint64_t bits, cudaStream_t stream);

// A column-major matrix of 2-byte elements given another leading dimension: for c < cols and
// r < rows, dst[c * ld_dst + r] = src[c * ld_src + r] (the same bits; elements between rows
// and a leading dimension are not touched). matmul stages 16-bit operands whose leading
// dimension is not a multiple of 8 through it (kernels/cuda/matmul.cc).
void launch_repitch16(void* dst, int64_t ld_dst, const void* src, int64_t ld_src, int64_t rows, int64_t cols,
                      cudaStream_t stream);

}  // namespace tessera::cuda_kernels
