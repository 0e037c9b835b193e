// The two Fashion-MNIST classifiers of the example, as nn modules (torch.nn equivalents in
// tools/bench/mnist_torch.py build the same layers with the same shapes):
//   mlp: Flatten, Linear(784, 256), ReLU, Linear(256, 10)
//   cnn: Conv2d(1, 32, 3, pad 1), ReLU, MaxPool 2, Conv2d(32, 64, 3, pad 1), ReLU, MaxPool 2,
//        Flatten, Linear(3136, 128), ReLU, Linear(128, 10)
//
//   std::shared_ptr<nn::Module> net = mnist::make_model("cnn");   // input [N, 1, 28, 28]
#pragma once

#include <memory>
#include <string>

#include "nn/layers.h"

namespace tessera::mnist {

std::shared_ptr<nn::Sequential> make_mlp();
std::shared_ptr<nn::Sequential> make_cnn();
// "mlp" or "cnn"; anything else is an Error listing both.
std::shared_ptr<nn::Sequential> make_model(const std::string& name);

}  // namespace tessera::mnist
