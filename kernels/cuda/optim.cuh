// Launchers of the fused optimizer updates on CUDA (adamw_, adamw8bit_, sgd_), multi-tensor
// apply: one launch updates many chunks of many tensors, the tensor pointers and the chunk
// table travelling in the kernel's parameters (no host-to-device copy).
//
//   std::vector<OptimTuple> t = {{{p, g, m, v}, n}, ...};   // contiguous device pointers
//   launch_adamw(kF32, /*master=*/false, t.data(), t.size(), consts, stream);
//
// Pointer order in OptimTuple::ptr: adamw_ (param, grad, exp_avg, exp_avg_sq[, master]);
// adamw8bit_ (param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax[, master]);
// sgd_ (param, grad[, momentum_buffer][, master]). Every tuple of one launch has the same
// param dtype and the same optional operands.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

struct OptimTuple {
  void* ptr[7] = {};
  int64_t numel = 0;
};

// The AdamW constants as the CPU computes them (in f64; kernels/cpu/optim.cc), rounded to
// the state type by the launcher.
struct AdamWConsts {
  double decay;      // 1 - lr * weight_decay
  double w1;         // 1 - beta1
  double beta2, w2;  // beta2, 1 - beta2
  double bc2_sqrt;   // sqrt(1 - beta2^t)
  double eps;
  double step_size;  // lr / (1 - beta1^t)
  double grad_scale = 1.0;  // the gradient read as grad * grad_scale (clipping), when != 1
};

// adamw8bit_'s quantization blocks: tensor/quant8.h's kQuant8Block (the .cu files do not
// include tensor/; optim.cc asserts the two equal).
inline constexpr int kAdam8Block = 256;

// Host pointers to tensor/quant8.h's two maps, index 0 the signed one (exp_avg), 1 the
// unsigned one (exp_avg_sq); each array has kAdam8Block entries. The launcher copies them
// into the kernel's parameters.
struct Quant8Maps {
  const float* values[2];
  const float* thresholds[2];  // f32 state
  const double* mid64[2];      // f64 state
};

struct SgdConsts {
  double lr, weight_decay, momentum, one_minus_dampening;
  bool decay, nesterov, first;
  double grad_scale = 1.0;  // as AdamWConsts's
};

void launch_adamw(int dtype, bool master, const OptimTuple* tuples, int64_t count,
                  const AdamWConsts& k, cudaStream_t stream);
// k is adamw_'s; every tuple's operands contiguous.
void launch_adamw8bit(int dtype, bool master, const OptimTuple* tuples, int64_t count,
                      const AdamWConsts& k, const Quant8Maps& maps, cudaStream_t stream);
void launch_sgd(int dtype, bool buffer, bool master, const OptimTuple* tuples, int64_t count,
                const SgdConsts& k, cudaStream_t stream);

// scale_ on one contiguous tensor: x = x * scale in acc_type (the scale rounded to it).
void launch_scale(const DevTensor& x, double scale, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
