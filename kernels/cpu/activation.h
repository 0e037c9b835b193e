// The activations of linear (tensor/ops.h) over contiguous runs, for kernels that apply them
// inside another loop (linear's GEMM epilogue and its backward). Each element gets the bits
// the activation's own op kernel gives it (relu, gelu, gelu_backward in elementwise.cc, the
// same vectorised path), wherever the run starts.
//
//   activation_run(Activation::gelu_tanh, pre, y, n);          // y = gelu(pre)
//   activation_backward_run(Activation::gelu_tanh, g, pre, dpre, n);  // dpre = g * gelu'(pre)
#pragma once

#include <cstdint>

#include "tensor/op.h"

namespace tessera::cpu {

// y[i] = act(x[i]), i < n (Activation::none copies). x and y may be the same array.
void activation_run(Activation act, const float* x, float* y, int64_t n);
void activation_run(Activation act, const double* x, double* y, int64_t n);
// out[i] = g[i] * act'(x[i]) (relu: x > 0 ? g : 0, as relu's derivative).
void activation_backward_run(Activation act, const float* g, const float* x, float* out, int64_t n);
void activation_backward_run(Activation act, const double* g, const double* x, double* out, int64_t n);

}  // namespace tessera::cpu
