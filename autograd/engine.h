// The backward engine: runs the graph in reverse from one or more roots.
//
//   autograd::backward({loss});                          // accumulate into every leaf's .grad
//   auto g = autograd::grad({loss}, {x, w});             // gradients returned, .grad untouched
//
// Nodes run when every gradient for them has arrived (dependency counts); among ready nodes
// the most recently created runs first, so a model's last layer finishes its backward first
// (data parallel relies on that order to launch gradient reductions early). Derivatives run
// with grad mode off. Without retain_graph, saved tensors are freed as each node finishes.
#pragma once

#include <vector>

#include "autograd/node.h"

namespace tessera::autograd {

// Accumulates d(sum_i <roots[i], grads[i]>)/d(leaf) into each leaf's .grad. grads may be
// empty when every root is a one-element tensor (its gradient is 1).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {},
              bool retain_graph = false);

// Returns the gradients w.r.t. `inputs` (undefined where no path leads) without touching
// any .grad.
std::vector<Tensor> grad(const std::vector<Tensor>& roots, const std::vector<Tensor>& inputs,
                         const std::vector<Tensor>& grads = {}, bool retain_graph = false);

// The engine itself: `accumulate` runs leaf accumulators; gradients arriving for `capture`
// are returned (and captured leaves are not accumulated).
std::vector<Tensor> run_backward(const std::vector<Tensor>& roots,
                                 const std::vector<Tensor>& grads, bool retain_graph,
                                 bool accumulate, const std::vector<Tensor>& capture);

}  // namespace tessera::autograd
