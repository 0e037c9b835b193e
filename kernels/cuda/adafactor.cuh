// Launchers of Adafactor's fused passes on CUDA (tensor/ops.h: adafactor_stats_,
// adafactor_norm_, adafactor_apply_), over contiguous [B, M, N] matrices in f32 (f64: false)
// or f64. The sums accumulate in f64 in a fixed order (one block per row, then the rows'
// partial sums in row order), so they do not depend on scheduling.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tessera::cuda_kernels {

// out [B, M + N]: the rows' then the columns' sums of g^2 + eps.
void launch_adafactor_stats(bool f64, const void* g, void* out, int64_t B, int64_t M,
                            int64_t N, double eps, cudaStream_t stream);
// *out (one f64 on the device) = the sum of the update's squares; `rows_scratch` holds
// B * M doubles.
void launch_adafactor_norm(bool f64, const void* g, const void* a, const void* b, double* out,
                           double* rows_scratch, int64_t B, int64_t M, int64_t N, bool product,
                           double divisor, double floor, cudaStream_t stream);
// param (and exp_avg when not null) updated in place.
void launch_adafactor_apply(bool f64, void* param, const void* g, const void* a, const void* b,
                            void* exp_avg, int64_t B, int64_t M, int64_t N, bool product,
                            double divisor, double floor, double scale, double beta1, double c,
                            int form, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
