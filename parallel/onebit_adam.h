// 1-bit Adam (Tang et al., ICML 2021; DeepSpeed's OnebitAdam): an optimizer and a reduction
// that work as a pair over a data-parallel group.
//
//   OnebitAdam opt(groups, comm, {.lr = 1e-3, .freeze_step = 100});
//   DistributedDataParallel ddp(model, comm, {.comm_hook = opt.comm_hook()});
//   ... ddp.backward(loss); opt.step();
//
// Warm-up (steps 1..freeze_step): DDP reduces the gradients exactly (the hook's all-reduce)
// and the step is AdamW's (adamw_, bias-corrected; bias_correction false: DeepSpeed's
// m / (sqrt(v) + eps)). After it the variance is frozen, DDP sends nothing (the hook leaves
// each rank its own gradient), and each step:
//   m = m + (1 - beta1) (g - m)          with this rank's gradient (the hook scales it by the
//                                        group size when DDP sums: gpt's ranks backpropagate
//                                        shares of the mean), so it is on the reduced one's scale
//   d = sqrt(v / bc2_frozen) + eps       AdamW's denominator, fixed from here on
//   u = onebit_all_reduce(clamp(m / d))  1 bit per element and a scale per tensor and chunk,
//                                        worker and server error feedback (parallel/onebit.h)
//   m = u d
//   p = p (1 - lr wd) - lr / bc1 * u
// (clamp: OnebitAdamOptions::bound_update, the largest |m| / sqrt(v) AdamW reaches). With
// precondition false (the paper's, DeepSpeed's) m itself is reduced, unclamped, and
// u = m / d. d is the same on every rank, so both average the same thing; they differ in
// what the signs' scale is spread over (OnebitAdamOptions::precondition). The default
// scale is l1 (mean |x|), DeepSpeed's is l2 (onebit.h). On the default GPT the paper's pair
// (momentum, l2) diverges after the freeze and the default does not; on the MNIST CNN the
// clamp is what keeps the default from diverging (BENCHMARKS.md).
// About 1/32 of the bytes of an f32 gradient all-reduce per step. Each rank's error feedback
// lives in the hook (a per-rank state, checkpointed per rank as every comm hook's is); the
// optimizer's state (m, v, step) is the same on every rank. Not for ZeRO's flat shards (a
// scale per tensor): elementwise() is false. Gradient clipping before step() sees, after the
// warm-up, each rank's own gradient on the reduced gradient's scale (not reduced): a caller
// that clips by the global norm clips something else than the AdamW run does. Over pipeline
// stages and tp shards (gpt's --pp/--tp at ZeRO 0) each rank steps the tensors it holds, so
// the scales are per stage tensor and per tp shard.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "optim/optimizer.h"
#include "parallel/comm_hook.h"
#include "parallel/onebit.h"

namespace tessera::parallel {

struct OnebitAdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t freeze_step = 100;    // warm-up steps, exact (DeepSpeed: 15-25% of the run)
  bool bias_correction = true;  // AdamW's; false: DeepSpeed's uncorrected update
  // After the freeze, what goes through the 1-bit all-reduce: true (the default) the update
  // u = m / (sqrt(v) + eps) (v frozen and the same on every rank, so averaging u is averaging
  // m), whose elements are all on AdamW's step scale; false: m itself (the paper's and
  // DeepSpeed's), where an element whose frozen v is tiny (a rare byte's embedding row, a
  // bias with no gradient) turns the chunk's sign scale into a step of lr x scale / sqrt(v).
  bool precondition = true;
  OnebitScale scale = OnebitScale::l1;  // the signs' scale (parallel/onebit.h); l2: DeepSpeed's
  // With precondition: each element of u is clamped, before it is sent, to the largest
  // |m| / sqrt(v) any gradient sequence gives AdamW, B = (1 - beta1) / sqrt((1 - beta2)
  // (1 - beta1^2 / beta2)) (Cauchy-Schwarz on the two moving sums; none when beta1^2 >=
  // beta2), times sqrt(bc2_frozen) as u carries it. Running AdamW stays inside B because v
  // grows with a new gradient; frozen, v does not, and an element whose gradient was near
  // zero during the warm-up and appears afterwards (a unit that was dead, a filter that
  // wakes up) would send m / eps and set its whole chunk's scale.
  bool bound_update = true;
};

class OnebitAdam;

// DDP's side: the exact reduction while the optimizer warms up, none afterwards; each rank's
// error feedback per parameter (by the optimizer's global index).
class OnebitAdamHook : public CommHook {
 public:
  // Made before its optimizer where DDP must have it first (ZeroOptions::comm_hook); the
  // OnebitAdam built with it attaches itself. Reducing before that is an error.
  OnebitAdamHook() = default;
  std::string name() const override { return "onebit_adam"; }
  WorkHandle reduce(Communicator& comm, const GradBucket& bucket) override;
  void end_round() override;
  // "worker.<i>" [padded], "server.<i>" [padded / ranks] for each parameter i stepped
  // compressed so far.
  std::map<std::string, Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, Tensor>& dict) override;
  Traffic last_round() const override { return last_; }
  bool full_reduction() const override { return false; }

 private:
  friend class OnebitAdam;
  const OnebitAdam* opt_ = nullptr;
  std::map<int64_t, std::pair<Tensor, Tensor>> errors_;
  Traffic last_, current_;
};

class OnebitAdam : public optim::Optimizer {
 public:
  // `hook`: one made beforehand for DDP (null: its own, from comm_hook()).
  OnebitAdam(std::vector<optim::ParamGroup> groups, Communicator& comm,
             OnebitAdamOptions options = {}, std::shared_ptr<OnebitAdamHook> hook = nullptr);
  ~OnebitAdam() override;

  void step() override;
  bool elementwise() const override { return false; }
  const OnebitAdamOptions& options() const { return options_; }
  // The hook DDP must reduce with (DdpOptions::comm_hook).
  std::shared_ptr<OnebitAdamHook> comm_hook() const { return hook_; }
  // Steps taken (the most any parameter took): warm-up while <= freeze_step.
  int64_t steps_done() const;
  // B of bound_update (infinity when beta1^2 >= beta2).
  double update_bound() const;

 protected:
  std::vector<StateSpec> state_specs(const Tensor& param) const override;
  std::map<std::string, double> hyperparameters() const override;
  std::map<std::string, double> hyperparameters_before() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;

 private:
  // After the freeze: this rank's momentum updated and padded for the 1-bit all-reduce, with
  // its error feedback (worker, server); then the update from the reduced momentum.
  struct Local {
    Tensor sent;  // [padded]: m, or m / denominator (precondition)
    Tensor worker_error, server_error;
    Tensor denominator;  // sqrt(v / bc2_frozen) + eps, v frozen
  };
  Local local_momentum(const Pending& item);
  void compressed_update(const optim::ParamGroup& group, const Pending& item,
                         const Tensor& reduced, const Tensor& denom);
  // Error naming the parameter if its saved error feedback does not fit this group.
  void check_errors(const Pending& item) const;

  Communicator& comm_;
  OnebitAdamOptions options_;
  std::shared_ptr<OnebitAdamHook> hook_;
};

}  // namespace tessera::parallel
