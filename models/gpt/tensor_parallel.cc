#include "models/gpt/tensor_parallel.h"

#include <fmt/format.h>

#include "models/gpt/forward.h"
#include "tensor/error.h"

namespace tessera::gpt {

namespace {

// Checked before any parameter is sharded (a collective-free error on every rank).
const parallel::MeshPtr& check_heads(const GptConfig& config, const parallel::MeshPtr& mesh,
                                     const std::string& tp_axis) {
  const int64_t tp = mesh->size(tp_axis);
  TS_CHECK(config.heads % tp == 0,
           "TpGpt: heads ({}) must be divisible by the tp size ({}): each rank computes whole "
           "heads; tp must divide {}",
           config.heads, tp, config.heads);
  return mesh;
}

}  // namespace

parallel::TpPlan megatron_plan() {
  using namespace parallel;
  // A Mixture-of-Experts block's experts (fc [E, C, H], proj [E, H, C]) split like the dense
  // MLP: each expert's hidden units over tp (expert tensor parallelism); the router and the
  // output bias whole.
  const TpPlan experts = {{"h.*.mlp.fc_weight", Shard(2)}, {"h.*.mlp.fc_bias", Shard(1)},
                          {"h.*.mlp.proj_weight", Shard(1)}};
  return column_wise("h.*.attn.c_attn", /*groups=*/3) + row_wise("h.*.attn.c_proj") +
         column_wise("h.*.mlp.c_fc") + row_wise("h.*.mlp.c_proj") + experts + vocab_parallel("wte");
}

TpGpt::TpGpt(const Gpt& model, parallel::MeshPtr mesh, const parallel::TpPlan& plan,
             std::string tp_axis, std::string batch_axis,
             const std::function<bool(const std::string&)>& keep)
    : config_(model.config()),
      params_(model, check_heads(config_, mesh, tp_axis), plan, tp_axis, keep),
      layout_(mesh, tp_axis, std::move(batch_axis)) {}

parallel::ShardedTensor TpGpt::embed(const Tensor& idx) {
  return gpt::embed(layout_, params_, config_, idx, {config_.dropout, training_});
}

parallel::ShardedTensor TpGpt::block(int64_t i, const parallel::ShardedTensor& x) {
  return gpt::block(layout_, Prefixed<parallel::ShardedParameters>{params_, fmt::format("h.{}.", i)},
                    config_, i, x, {config_.dropout, training_});
}

parallel::ShardedTensor TpGpt::head(const parallel::ShardedTensor& x) {
  return gpt::head(layout_, params_, config_, x);
}

parallel::ShardedTensor TpGpt::forward(const Tensor& idx) {
  const DropoutKeys keys(config_, training_, idx.dim() == 2 ? idx.size(0) : 0,
                         idx.dim() == 2 ? idx.size(1) : 0);
  parallel::ShardedTensor x = embed(idx);
  for (int64_t i = 0; i < config_.layers; ++i) {
    keys.at(i + 1);  // each block's dropout from its own offset (forward.h)
    x = block(i, x);
  }
  keys.end();
  return head(x);
}

parallel::ShardedTensor TpGpt::loss(const Tensor& idx, const Tensor& targets) {
  return vocab_parallel_loss(forward(idx), targets);
}

parallel::ShardedTensor TpGpt::vocab_parallel_loss(const parallel::ShardedTensor& logits,
                                                   const Tensor& targets) {
  return gpt::loss(layout_, logits, targets);
}

}  // namespace tessera::gpt
