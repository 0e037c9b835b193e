// A tensor as a CUDA kernel sees it: a plain struct (no Tensor, no CUDA types) that host
// glue (.cc, compiled by GCC) fills and .cu launchers take by value.
//
//   DevTensor x = dev_tensor(t);                  // kernels/cuda/runtime.h
//   launch_unary(OpId::exp, out, x, stream);      // a family's .cuh
//
// dtype uses DType's numbering (f32, f64, f16, bf16, i32, i64, b8); strides are in elements
// and data already includes the tensor's offset.
#pragma once

#include <cstdint>
#include <stdexcept>

namespace tessera::cuda_kernels {

inline constexpr int kMaxDims = 8;

enum DevDType : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kI64 = 5, kB8 = 6, kU8 = 7 };

struct DevTensor {
  void* data = nullptr;
  int dtype = kF32;
  int ndim = 0;
  int64_t numel = 1;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};

  bool contiguous() const {
    int64_t expected = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      if (sizes[d] != 1 && strides[d] != expected) return false;
      expected *= sizes[d];
    }
    return true;
  }
};

// Thrown by .cu launchers; run_launch (runtime.h) turns it into tessera::Error naming the op.
struct CudaLaunchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline int dev_dtype_size(int dtype) {
  switch (dtype) {
    case kF64: case kI64: return 8;
    case kF32: case kI32: return 4;
    case kF16: case kBF16: return 2;
    default: return 1;
  }
}

}  // namespace tessera::cuda_kernels
