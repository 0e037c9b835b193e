// GPT with Megatron-style tensor parallelism: the Megatron plan (parallel/tensor_parallel.h
// styles by parameter path) applied to a Gpt's parameters, and the one GPT forward
// (models/gpt/forward.h) run on the sharded parameters under a TpLayout. The sharding rules
// place the collectives; nothing here is a second forward.
//
//   auto mesh = make_mesh(world, {{"dp", 2}, {"tp", 2}});
//   TpGpt tp(model, mesh);                              // shards model's parameters
//   ShardedTensor loss = tp.loss(idx, targets);         // idx, targets [B, T]: S(0) on dp
//   loss.backward();                                    // tp.full_grad("h.0.mlp.c_fc.weight")
#pragma once

#include <functional>
#include <map>
#include <string>

#include "models/gpt/model.h"
#include "parallel/tensor_parallel.h"

namespace tessera::gpt {

// The qkv projection column-wise in three groups (each rank the q, k and v rows of its own
// heads), the MLP's first layer column-wise, both output projections row-wise (a Mixture-of-
// Experts block's experts alike, by their hidden dim), the token embedding and the tied head
// vocab-parallel; everything else replicated.
parallel::TpPlan megatron_plan();

class TpGpt {
 public:
  // Shards `model`'s parameters by `plan` on `tp_axis` (Replicate on other axes); inputs are
  // split over `batch_axis` when the mesh has it. Error when the heads do not divide by the
  // tp size. `keep` (when given) selects the parameters by path (a pipeline stage's).
  TpGpt(const Gpt& model, parallel::MeshPtr mesh, const parallel::TpPlan& plan = megatron_plan(),
        std::string tp_axis = "tp", std::string batch_axis = "dp",
        const std::function<bool(const std::string&)>& keep = nullptr);

  // idx [B, T] i64 -> logits [B, T, vocab], split over the vocabulary on tp.
  parallel::ShardedTensor forward(const Tensor& idx);
  parallel::ShardedTensor loss(const Tensor& idx, const Tensor& targets);
  // Mean cross-entropy of logits [B, T, V] (vocabulary split on tp) against targets [B, T]:
  // reductions over the split vocabulary only, never the full logits on one rank.
  parallel::ShardedTensor vocab_parallel_loss(const parallel::ShardedTensor& logits,
                                              const Tensor& targets);
  // The pieces a pipeline stage runs: embeddings of idx, block i, final LayerNorm and head.
  parallel::ShardedTensor embed(const Tensor& idx);
  parallel::ShardedTensor block(int64_t i, const parallel::ShardedTensor& x);
  parallel::ShardedTensor head(const parallel::ShardedTensor& x);
  // This rank's block of the residual stream as a sharded tensor of `global_shape`.
  parallel::ShardedTensor stream(const Tensor& x, const Shape& global_shape) const {
    return layout_.wrap_stream(x, global_shape);
  }

  const parallel::ShardedTensor& param(const std::string& name) const { return params_(name); }
  const std::map<std::string, parallel::ShardedTensor>& params() const { return params_.all(); }
  // Sequence parallelism: the residual stream split along the sequence on tp
  // (parallel::TpLayout::set_sequence_parallel).
  void set_sequence_parallel(bool on, MemoryTracker* region_tracker = nullptr) {
    layout_.set_sequence_parallel(on, region_tracker);
  }
  // Dropout (the model's p) runs in training mode only (the default), with the single-device
  // masks: the sharded op keys each element's draw by its global index.
  void set_training(bool on) { training_ = on; }
  void replace_local(const std::string& name, const Tensor& local) { params_.replace_local(name, local); }
  Tensor full_grad(const std::string& name) const { return params_.full_grad(name); }

 private:
  GptConfig config_;
  parallel::ShardedParameters params_;
  parallel::TpLayout layout_;
  bool training_ = true;
};

}  // namespace tessera::gpt
