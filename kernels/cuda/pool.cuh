// Launchers for max_pool2d and its backward on CUDA (NCHW, contiguous; pool.cc is the glue).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"
#include "kernels/cuda/index.cuh"

namespace tessera::cuda_kernels {

struct PoolWindow {
  int64_t kh, kw, sh, sw, ph, pw;
};

// x [N, C, H, W] -> y [N, C, OH, OW] and the argmax (i64, flat within each input plane).
void launch_max_pool2d(const DevTensor& y, const DevTensor& idx, const DevTensor& x,
                       const PoolWindow& win, cudaStream_t stream);

// Bytes of workspace launch_max_pool2d_backward needs.
int64_t max_pool2d_backward_workspace_bytes(const DevTensor& dx, bool windowed);
// dx [N, C, H, W] <- grad [N, C, OH, OW] summed at idx. windowed: idx came from a max_pool2d
// with `win` (each input element gathers from the windows that hold it); otherwise one thread
// per plane adds in output order (any in-plane indices).
void launch_max_pool2d_backward(const DevTensor& dx, const DevTensor& grad, const DevTensor& idx,
                                const PoolWindow& win, bool windowed, void* workspace,
                                DeviceErrorRecord* err, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
