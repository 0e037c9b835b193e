// The autograd graph: a Node per recorded op (or leaf accumulator), linked to the nodes
// that produced its inputs by Edges. Built by call() when an input requires grad; walked in
// reverse by the engine (engine.h).
//
//   Tensor y = x * w;                  // y.grad_fn() is an OpNode for mul
//   y.grad_fn()->name();               // "mul"
//   y.grad_fn()->next_edges();         // edges to x's and w's producers / accumulators
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/saved_compression.h"
#include "tensor/op.h"

namespace tessera::autograd {

class Node;

// Where a gradient goes next: output `input_nr` of node `fn` (null fn: nowhere).
struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  Node();
  virtual ~Node() = default;

  // Gradients w.r.t. this node's outputs in, gradients for each next edge out.
  // Undefined tensors stand for zero.
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) = 0;
  virtual std::string name() const = 0;
  // Frees saved tensors after a backward without retain_graph.
  virtual void release_saved() {}

  const std::vector<Edge>& next_edges() const { return next_edges_; }
  std::vector<Edge>& mutable_next_edges() { return next_edges_; }
  uint64_t sequence_nr() const { return sequence_nr_; }
  uint32_t num_outputs() const { return num_outputs_; }
  void set_num_outputs(uint32_t n) { num_outputs_ = n; output_hooks_.resize(n); }

  // Hooks on the gradient of output `nr` (Tensor::register_hook on a non-leaf).
  void add_output_hook(uint32_t nr, GradHook hook) { output_hooks_.at(nr).push_back(std::move(hook)); }
  const std::vector<GradHook>& output_hooks(uint32_t nr) const { return output_hooks_.at(nr); }
  // Runs the hooks on the gradients arriving for each output (the engine calls this before
  // apply(), and before handing a captured gradient back from autograd::grad).
  virtual void run_pre_hooks(std::vector<Tensor>& grads) const;

 private:
  std::vector<Edge> next_edges_;
  uint64_t sequence_nr_;
  uint32_t num_outputs_ = 1;
  std::vector<std::vector<GradHook>> output_hooks_{1};
};

// A tensor kept for backward: the data without its graph (compressed when this thread asks
// for it: autograd/saved_compression.h), plus the storage version at the time of saving, so
// an in-place overwrite before backward is reported instead of silently giving wrong
// gradients (for a compressed tensor, while its original storage is alive).
class SavedTensor {
 public:
  SavedTensor() = default;
  // compressible = false: kept as it is whatever this thread's setting (checkpoint inputs).
  explicit SavedTensor(const Tensor& t, bool compressible = true);
  Tensor unpack(std::string_view op) const;
  void reset() {
    packed_ = PackedTensor();
    source_.reset();
  }
  bool defined() const { return packed_.data.defined(); }

 private:
  PackedTensor packed_;
  std::weak_ptr<StorageImpl> source_;  // the original's storage, when compressed
  uint64_t version_ = 0;
};

// Accumulates into a leaf's .grad (the end of every path to a parameter).
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor variable);
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  std::string name() const override { return "AccumulateGrad"; }
  // Also runs the hooks registered on the leaf itself (Tensor::register_hook).
  void run_pre_hooks(std::vector<Tensor>& grads) const override;
  const Tensor& variable() const { return variable_; }

 private:
  Tensor variable_;
};

// The edge a gradient for `t` should travel (invalid if t does not require grad).
Edge gradient_edge(const Tensor& t);

}  // namespace tessera::autograd
