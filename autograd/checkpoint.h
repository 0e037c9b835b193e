// Activation recomputation. checkpoint(fn, inputs) runs fn without keeping its intermediate
// activations (only `inputs` are saved); backward reruns fn with the same RNG counters, so
// dropout masks match, and backpropagates through the recomputed graph. Gradients are
// exactly those of running fn directly.
//
//   Tensor h = autograd::checkpoint([&](const std::vector<Tensor>& in) {
//     return std::vector<Tensor>{block.forward(in[0])};
//   }, {x})[0];
//
// Tensors that require grad must be passed in `inputs` unless they are leaves (parameters
// captured by fn are fine: their gradients accumulate into .grad during the rerun). Random
// draws inside fn must use the thread's default generator (its state is replayed, with the
// forward's batch slice, tensor/random.h).
#pragma once

#include <functional>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::autograd {

using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs);

// True while a checkpoint's backward reruns its function on this thread: a layer that
// records what its forward saw (routing statistics) records the first run only.
bool recomputing();

}  // namespace tessera::autograd
