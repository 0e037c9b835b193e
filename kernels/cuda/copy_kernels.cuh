// Device-side copy and fill launchers, plain C++ interfaces so callers need no CUDA headers
// beyond cuda_runtime.h.
#pragma once

#include <cstdint>

namespace tessera::cuda_kernels {

inline constexpr int kMaxDims = 8;

// Copies `numel` elements of `elem_size` bytes between two device buffers laid out with
// the given shape and element strides (up to kMaxDims dims), on the current stream.
void launch_strided_copy(void* dst, const void* src, int ndim, const int64_t* shape,
                         const int64_t* dst_strides, const int64_t* src_strides,
                         int64_t numel, int elem_size);

// Writes `numel` copies of the `elem_size`-byte pattern at `value` (host memory) to dst.
void launch_fill(void* dst, const void* value, int64_t numel, int elem_size);

}  // namespace tessera::cuda_kernels
