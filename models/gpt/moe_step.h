// What a training step does for GPT's Mixture-of-Experts blocks (nn/moe.h), the same on one
// device and with data parallelism: the routing counts reduced over the dp group (so the
// balancing loss uses the global batch's counts), each micro-batch's routing gathered into
// the step's, the aux-loss-free selection bias moved from the step's global counts, and the
// progress line's and the metrics' load figures.
//
//   MoeStep moe(config, comm, ep);
//   moe.begin_step();
//   { auto counts = moe.reduction();  nn::MoeDispatchScope d(moe.dispatch());
//     nn::MoeStatsScope s;  forward...;  moe.add(s);  backward... }   // each micro-batch
//   ... optimizer step ...;  moe.update_bias(model);
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

#include "models/gpt/model.h"
#include "parallel/comm/communicator.h"
#include "parallel/expert_parallel.h"

namespace tessera::gpt {

class MoeStep {
 public:
  // comm: the dp group (null: one rank). ep > 1 splits the experts over groups of ep
  // consecutive dp ranks (collective: every rank of comm constructs its MoeStep).
  MoeStep(const GptConfig& config, parallel::Communicator* comm, int64_t ep = 1);
  bool on() const { return config_.experts > 0; }
  // The expert-parallel dispatch for the layers' scope (null: every expert runs here).
  nn::MoeDispatch* dispatch() const { return groups_ ? &groups_->dispatch() : nullptr; }
  // The ep and expert-data-parallel groups (null without ep): a layout whose ranks keep
  // only their experts (groups()->keep) reduces those over groups()->subgroup().
  parallel::ExpertGroups* groups() const { return groups_.get(); }
  // The counts' all-reduce over the dp group, installed while alive (none with one rank).
  std::unique_ptr<nn::MoeCountReduction> reduction() const;
  // Starts a step's routing; add() then merges the forwards `scope` saw (by layer name),
  // `micro_batches` of them per layer.
  void begin_step();
  void add(const nn::MoeStatsScope& scope, int micro_batches = 1);
  // Collective over `pp`, whose ranks each recorded their own stages' blocks: afterwards
  // every rank holds every block's routing (for the progress line and the metrics).
  void gather(parallel::Communicator& pp);
  // DeepSeek-V3's bias update of every Mixture-of-Experts block from the step's counts.
  void update_bias(Gpt& model) const;
  const std::vector<nn::MoeLayerStats>& layers() const { return layers_; }
  // The mean over micro-batches of the attached losses (aux + z) summed over the blocks.
  double loss() const { return micro_batches_ > 0 ? loss_sum_ / micro_batches_ : 0.0; }
  // "  moe max/mean 1.31 dropped 0.4% aux 0.0102": the worst block's imbalance.
  std::string line() const;
  // record["moe"] = [{"layer", "counts", "dropped", "tokens", "aux_loss", "z_loss"}, ...].
  void annotate(nlohmann::json& record) const;

 private:
  GptConfig config_;
  parallel::Communicator* comm_;
  std::unique_ptr<parallel::ExpertGroups> groups_;
  std::vector<nn::MoeLayerStats> layers_;
  double loss_sum_ = 0.0;
  int micro_batches_ = 0;
};

}  // namespace tessera::gpt
