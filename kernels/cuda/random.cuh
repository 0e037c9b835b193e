// Launchers of the CUDA random and range factories (random.cu): rand, randn, dropout and
// arange. Random values are keyed by (seed, counter) through tensor/random.h's Philox, with
// the CPU's counters, so rand and the dropout mask are bitwise the CPU's.
//
//   RngMap m = ...;                          // random.cc: from Attrs offset and rng_view
//   launch_rand(dev_tensor(out), seed, m, stream);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// Local linear index i -> counter: offset + i, or, for a block of a larger logical tensor
// (ndim > 0), offset + base + sum over d of coordinate_d(i) * global_strides[d].
struct RngMap {
  uint64_t offset = 0;
  int ndim = 0;
  int64_t base = 0;
  int64_t local[kMaxDims] = {};
  int64_t global_strides[kMaxDims] = {};
};

void launch_rand(const DevTensor& out, uint64_t seed, const RngMap& m, cudaStream_t stream);
void launch_randn(const DevTensor& out, uint64_t seed, const RngMap& m, cudaStream_t stream);
// out = keep ? x * 1 / (1 - p) : 0, keep = uniform(seed, counter) >= p; x contiguous.
void launch_dropout(const DevTensor& out, const DevTensor& x, double p, uint64_t seed,
                    const RngMap& m, cudaStream_t stream);
// out[i] = start + step * i (f64, fused multiply-add as the CPU's loop), converted.
void launch_arange(const DevTensor& out, double start, double step, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
