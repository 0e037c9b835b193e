// GPT with Megatron-style tensor parallelism, expressed as sharding specs (parallel/): a plan
// maps parameter paths to a placement on the "tp" mesh axis, and the forward runs the sharded
// ops, whose rules place the collectives (no hand-written all-reduce).
//
//   auto mesh = make_mesh(world, {{"dp", 2}, {"tp", 2}});
//   TpGpt tp(model, mesh, megatron_plan());            // shards model's parameters
//   ShardedTensor loss = tp.loss(idx, targets);         // idx, targets [B, T]: S(0) on dp
//   loss.backward();                                    // tp.param("h.0.mlp.c_fc.weight").grad()
//
// The Megatron plan: the fused qkv weight, viewed as [3, C, C], and the MLP's first layer are
// column-parallel (their output features split over tp, whole heads per rank); the attention
// and MLP output projections are row-parallel (input features split: a Partial product);
// the token embedding and the tied LM head are vocab-parallel, with a cross-entropy that
// reduces over the split vocabulary; everything else is replicated. The forward only annotates the residual stream's layout
// (with_sharding_constraint: whole on tp); the rules then give Megatron's collectives: the
// Partial products are all-reduced in forward, and the stream's gradient is all-reduced in
// backward where it meets the column-parallel weights. set_sequence_parallel() splits the
// stream along the sequence instead.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/gpt/model.h"
#include "parallel/ops.h"
#include "tensor/allocator.h"

namespace tessera::gpt {

struct TpSpec {
  std::string pattern;   // dotted parameter path; "*" matches one component ("h.*.mlp.c_fc.weight")
  Shape view = {};       // the shape the placement applies to (empty: the parameter's own)
  parallel::Placement placement = parallel::Replicate();  // on the tp axis
};
using TpPlan = std::vector<TpSpec>;

TpPlan megatron_plan();

class TpGpt {
 public:
  // Shards `model`'s parameters (every rank passes the same values: one seed). On mesh axes
  // other than `tp_axis` parameters are Replicate. Error when the heads or the MLP width do
  // not divide by the tp size (naming the dimension and the sizes that would).
  // `keep` (when given) selects the parameters to shard, by path: a pipeline stage keeps
  // only its layers'.
  TpGpt(const Gpt& model, parallel::MeshPtr mesh, TpPlan plan = megatron_plan(),
        std::string tp_axis = "tp", std::string batch_axis = "dp",
        const std::function<bool(const std::string&)>& keep = nullptr);

  // idx [B, T] i64 -> logits [B, T, vocab]. idx is split over batch_axis (when the mesh has
  // it) and replicated on the others.
  parallel::ShardedTensor forward(const Tensor& idx);
  parallel::ShardedTensor loss(const Tensor& idx, const Tensor& targets);
  // Mean cross-entropy of logits [B, T, V] (split over the vocab on tp) against targets
  // [B, T]: reductions of the split vocabulary only, never the full logits on one rank.
  parallel::ShardedTensor vocab_parallel_loss(const parallel::ShardedTensor& logits,
                                              const Tensor& targets);

  // The pieces (a pipeline stage runs some of them): embeddings of idx, block i, and the
  // final LayerNorm with the tied head. The residual stream is whole on tp.
  parallel::ShardedTensor embed(const Tensor& idx);
  parallel::ShardedTensor block(int64_t i, const parallel::ShardedTensor& x);
  parallel::ShardedTensor head(const parallel::ShardedTensor& x);
  // This rank's block of the residual stream (the whole stream, or with sequence parallelism
  // its part of the sequence) as a sharded tensor of `global_shape`; differentiable (the
  // gradient reaches `x`). A pipeline stage wraps what it received with it.
  parallel::ShardedTensor stream(const Tensor& x, const Shape& global_shape) const;

  // The sharded parameter by its path in the single-device model (its view where the plan
  // gives one).
  const parallel::ShardedTensor& param(const std::string& name) const;
  const std::map<std::string, parallel::ShardedTensor>& params() const { return params_; }
  // Sequence parallelism (Megatron-LM's, Korthikanti et al.): the residual stream, and with
  // it the LayerNorms and residual adds, is split along the sequence over tp; it is
  // all-gathered entering each column-parallel product and the row-parallel products are
  // reduce-scattered back to it, instead of all-reduced. When `region_tracker` is given,
  // the allocations of the LayerNorm and residual regions are charged to it (the memory
  // sequence parallelism divides by tp).
  void set_sequence_parallel(bool on, MemoryTracker* region_tracker = nullptr);
  // Dropout (the model's p) runs only in training mode (the default), with the single-device
  // masks: the sharded op keys each element's draw by its global index, and the calls
  // advance this thread's generator as the single-device model's do.
  void set_training(bool on) { training_ = on; }

  // Swaps in another handle for a parameter's local block (same shape and values): a wrapper
  // that registers the blocks in its own module (nn::Module::register_parameter makes new
  // leaves) hands its handles back, so forward, gradients and updates use those.
  void replace_local(const std::string& name, const Tensor& local);
  // The single-device shape of a parameter's gradient, gathered (collective).
  Tensor full_grad(const std::string& name) const;

 private:
  parallel::ShardedTensor input(const Tensor& t) const;
  parallel::ShardedTensor to_stream(const parallel::ShardedTensor& x) const;
  parallel::ShardedTensor column_input(const parallel::ShardedTensor& x) const;
  parallel::ShardedTensor region(const std::function<parallel::ShardedTensor()>& fn) const;
  parallel::ShardedTensor attention(int64_t i, const parallel::ShardedTensor& x);

  GptConfig config_;
  parallel::MeshPtr mesh_;
  std::string tp_axis_, batch_axis_;
  parallel::Placements column_placements_;  // S(0) on dp, whole elsewhere
  parallel::Placements stream_placements_;  // the residual stream: the same, or S(1) on tp
  bool sequence_parallel_ = false;
  bool training_ = true;
  MemoryTracker* region_tracker_ = nullptr;
  std::map<std::string, parallel::ShardedTensor> params_;
  std::map<std::string, Shape> shapes_;  // single-device shapes
};

}  // namespace tessera::gpt
