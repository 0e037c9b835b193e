// Launchers for the fused nn ops on CUDA: softmax / log_softmax, layer_norm (+ backward) and
// cross_entropy (+ backward). Tensors are contiguous (the host glue in nn.cc makes them so);
// workspaces are device buffers the glue allocates with the sizes asked for here.
//
//   launch_softmax(y, x, outer, d, inner, /*log=*/false, stream);
//   void* ws = ...layer_norm_backward_workspace_bytes(rows, cols, dtype)...;
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"
#include "kernels/cuda/index.cuh"

namespace tessera::cuda_kernels {

// x, y contiguous, viewed as [outer, d, inner] around the softmax dim.
void launch_softmax(const DevTensor& y, const DevTensor& x, int64_t outer, int64_t d,
                    int64_t inner, bool log, cudaStream_t stream);

// x, y [rows, cols]; mean, rstd [rows] (f32, or f64 for f64 x); w, b [cols] or data == null.
// add_layer_norm: r and s [rows, cols] (else data == null): the rows normalised are
// s = x + r, rounded to the dtype and written to s.
void launch_layer_norm(const DevTensor& y, const DevTensor& mean, const DevTensor& rstd,
                       const DevTensor& x, const DevTensor& w, const DevTensor& b, int64_t rows,
                       int64_t cols, double eps, cudaStream_t stream,
                       const DevTensor& r = DevTensor{}, const DevTensor& s = DevTensor{});

// Bytes of workspace launch_layer_norm_backward needs (0 when neither dw nor db is wanted).
int64_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t cols, int dtype, bool want_w,
                                            bool want_b);
// dx [rows, cols]; dw, db [cols] or data == null when not wanted; w data == null when absent.
// res [rows, cols] (data == null: none) is added to dx, which is rounded to the dtype first.
void launch_layer_norm_backward(const DevTensor& dx, const DevTensor& dw, const DevTensor& db,
                                const DevTensor& g, const DevTensor& x, const DevTensor& mean,
                                const DevTensor& rstd, const DevTensor& w, int64_t rows,
                                int64_t cols, void* workspace, cudaStream_t stream,
                                const DevTensor& res = DevTensor{});

// reduction: 0 mean, 1 sum, 2 none (Reduction's numbering).
int64_t cross_entropy_workspace_bytes(int64_t n);
// logits [n, c]; target [n] (i32/i64); loss [] or [n]; lse [n] (f32, f64 for f64 logits).
void launch_cross_entropy(const DevTensor& loss, const DevTensor& lse, const DevTensor& logits,
                          const DevTensor& target, int reduction, int64_t ignore_index,
                          void* workspace, DeviceErrorRecord* err, cudaStream_t stream);
// dx [n, c]; grad [] or [n]; lse [n].
void launch_cross_entropy_backward(const DevTensor& dx, const DevTensor& grad,
                                   const DevTensor& logits, const DevTensor& target,
                                   const DevTensor& lse, int reduction, int64_t ignore_index,
                                   void* workspace, DeviceErrorRecord* err, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
