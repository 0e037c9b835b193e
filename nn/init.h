// Parameter initialisers, drawn from Tessera's counter-based RNG (tensor/random.h) so a
// seeded model initialises identically everywhere. Each fills `t` in place (no graph) and
// returns it; `generator` defaults to this thread's.
//
//   manual_seed(0);
//   Tensor w = Tensor::empty({256, 784});
//   nn::init::kaiming_uniform_(w, std::sqrt(5.0));   // torch.nn.Linear's default
#pragma once

#include <utility>

#include "tensor/ops.h"

namespace tessera::nn::init {

enum class FanMode { fan_in, fan_out };
enum class Nonlinearity { linear, relu, leaky_relu, tanh, sigmoid };

// (fan_in, fan_out) of a weight: dim 1 x receptive field, dim 0 x receptive field.
std::pair<int64_t, int64_t> fans(const Tensor& t);
// PyTorch's gain for the nonlinearity (`param` is leaky_relu's negative slope).
double gain(Nonlinearity nonlinearity, double param = 0.01);

Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* generator = nullptr);
Tensor& uniform_(Tensor& t, double low = 0.0, double high = 1.0, Generator* generator = nullptr);
Tensor& zeros_(Tensor& t);
Tensor& ones_(Tensor& t);
Tensor& constant_(Tensor& t, double value);
// He et al.: bound = gain * sqrt(3 / fan), gain from leaky_relu with slope `a` by default.
Tensor& kaiming_uniform_(Tensor& t, double a = 0.0, FanMode mode = FanMode::fan_in,
                         Nonlinearity nonlinearity = Nonlinearity::leaky_relu,
                         Generator* generator = nullptr);
Tensor& kaiming_normal_(Tensor& t, double a = 0.0, FanMode mode = FanMode::fan_in,
                        Nonlinearity nonlinearity = Nonlinearity::leaky_relu,
                        Generator* generator = nullptr);
// Glorot & Bengio: bound = gain * sqrt(6 / (fan_in + fan_out)).
Tensor& xavier_uniform_(Tensor& t, double gain = 1.0, Generator* generator = nullptr);
Tensor& xavier_normal_(Tensor& t, double gain = 1.0, Generator* generator = nullptr);

}  // namespace tessera::nn::init
