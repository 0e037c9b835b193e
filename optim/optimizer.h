// Optimizer: the base of SGD and AdamW. It holds parameter groups (each with its own lr and
// weight decay), per-parameter state, and a state dict made of tensors only.
//
//   AdamW opt(decay_groups(model.named_parameters(), 3e-4, 0.1));
//   for (int64_t step = 0; step < steps; ++step) {
//     opt.set_lr(schedule.lr(step));
//     opt.zero_grad();
//     loss(batch(step)).backward();
//     opt.step();
//   }
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace tessera {
enum class OpId : uint16_t;  // tensor/op.h
struct Attrs;
}  // namespace tessera

namespace tessera::optim {

// A parameter an optimizer steps that is a block of whole rows of a larger tensor (ZeRO with
// ZeroOptions::row_shards): the tensor's shape (1-D or 2-D), and the rows this block holds of
// it viewed [rows, last dim] (a 1-D tensor: rows of one element). `sum` adds a tensor over
// every block of the same parameter (an all-reduce over the shard group), in place; every
// holder calls it alike, in the same order, a holder of no rows too.
//
// Block shards (ZeroOptions::block_shards, `block` > 0): the "rows" are instead blocks of
// `block` consecutive elements of the flattened parameter (its last block may be short).
// `name` is the parameter's (for per-parameter options such as AdamW8bit's f32_state).
//
// A tensor-parallel shard of a matrix may hold only some of its columns too: then `cols_sum`
// adds a tensor over the ranks holding the same rows' other columns (the shard's columns are
// its numel / rows), and `sum` is over the ranks holding the other rows of the same columns.
// Null: the shard has whole rows.
//
// Block shards of a tensor-parallel shard: `run` > 0 says the tensor the blocks are cut from
// holds runs of `run` consecutive elements of the whole parameter (flattened), its run r
// starting at element r * run_stride + run_first of the whole; its blocks are the whole's
// when `run` and run_first are multiples of the block. Otherwise a block of the whole may lie
// partly on other ranks: `max` then max-reduces a tensor, in place, over every rank holding
// part of the parameter (ZeRO's group and tp's), every holder calling it alike.
struct RowShard {
  Shape global;
  int64_t first_row = 0, rows = 0;
  std::function<void(const Tensor&)> sum;
  int64_t block = 0;
  std::string name = {};
  std::function<void(const Tensor&)> cols_sum = nullptr;
  int64_t run = 0, run_stride = 0, run_first = 0;
  std::function<void(const Tensor&)> max = nullptr;
};

struct ParamGroup {
  // Marks lr / weight_decay as "the optimizer's default" (the options it was built with).
  static constexpr double kInherit = std::numeric_limits<double>::quiet_NaN();

  // Default member initializers keep ParamGroup{{w, b}} free of missing-initializer warnings.
  std::vector<Tensor> params = {};
  std::vector<std::string> names = {};  // empty, or one per param (used in error messages)
  double lr = kInherit;
  double weight_decay = kInherit;
};

// Two groups from named parameters: group 0 decays (weight_decay), group 1 does not (0).
// The rule, as in nanoGPT/minGPT: a parameter with 2 or more dims (matmul and embedding
// weights, conv kernels) decays; one with fewer (biases, layer-norm gains and shifts,
// scalars) does not, because shrinking those towards 0 regularises nothing useful and
// only fights the normalisation. Both groups are always returned (possibly empty), so group
// indices in a state dict do not depend on the model.
std::vector<ParamGroup> decay_groups(const std::vector<std::pair<std::string, Tensor>>& named_params,
                                     double lr, double weight_decay);

// Gradient accumulation needs no special class: backward() adds into .grad, so for k
// micro-batches per step call zero_grad() once, then (loss_i / k).backward() for each
// micro-batch, then step() once:
//
//   opt.zero_grad();
//   for (int i = 0; i < k; ++i) (loss(micro_batch(i)) / double(k)).backward();
//   opt.step();
//
// Dividing each loss by k makes the accumulated gradient that of the mean loss over the whole
// batch, as one backward over all of it would give (for a loss that is a mean over equally
// sized micro-batches), up to f32 summation order (tests/optim/accumulation_test.cc).
class Optimizer {
 public:
  using StateDict = std::map<std::string, Tensor>;

  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Drops every parameter's gradient (PyTorch's set_to_none): the next backward allocates.
  // Drops a pending gradient scale too.
  void zero_grad();
  // One update of every parameter that has a gradient (those without are skipped, their
  // state untouched). Runs under NoGradGuard.
  virtual void step() = 0;
  // Gradient clipping's coefficient, for the next step() (optim::clip_grad_norm(Optimizer&,
  // max_norm) calls this). An optimizer that fuses it (fuses_grad_scale()) reads every
  // gradient as grad * scale in its update, rounded as scale_ would have written it, so
  // the update is bitwise the one after scale_(grads, scale), with one pass less over the
  // gradients; .grad keeps the unscaled values. Any other optimizer scales the gradients
  // now, in place, with scale_. step() and zero_grad() drop the pending scale; a second call
  // before step() first applies the pending one with scale_ (as two scale_ calls would).
  void scale_grads(double scale);
  // Whether step() applies scale_grads()'s coefficient itself (AdamW, AdamW8bit, SGD).
  virtual bool fuses_grad_scale() const { return false; }
  // The coefficient the next step() applies (1: none). Until then .grad (and a norm taken of
  // it) is unscaled.
  double pending_grad_scale() const { return grad_scale_; }
  // Writes a pending coefficient into the gradients with scale_ (as scale_grads would have
  // without fusing) and drops it: for code that reads .grad before step(), and for a step
  // that is skipped while the gradients are kept (DynamicLossScaler).
  void apply_pending_grad_scale();
  // The contract sharded training relies on: true when step() updates each element from
  // that element's parameter, gradient and state alone (SGD, AdamW), so running it on any
  // slice of a parameter (ZeRO's flat 1-D shards, parallel/zero.h) gives the same values as
  // on the whole. An optimizer that looks at a tensor as a whole (per-tensor norms as in
  // LAMB, shapes as in Shampoo or Muon) returns false, and ZeRO stages 1-3 refuse it.
  virtual bool elementwise() const = 0;
  // Whether an optimizer that is not elementwise still gives the whole-tensor update on row
  // shards, given each one's RowShard (set_row_shards; Adafactor does).
  virtual bool supports_row_shards() const { return false; }
  // > 0: an optimizer that is not elementwise but gives the whole-tensor update on shards cut
  // at multiples of this many elements of each parameter (block shards, see RowShard), as
  // AdamW8bit does with its quantization blocks.
  virtual int64_t shard_block() const { return 0; }
  // For a wrapper that hands the optimizer row shards: `shards` maps a parameter (the shard
  // tensor the optimizer was built on) to where it sits. Before the first step.
  void set_row_shards(std::map<const TensorImpl*, RowShard> shards) { row_shards_ = std::move(shards); }
  // How a row shard's state tensor `name` relates to the whole parameter's (of shape
  // `global`, RowShard::global; `run`, `run_first`: RowShard's), for gathering and cutting
  // checkpoints: its own elements (shaped as the shard), one value per row (the rows' block
  // of a [rows] tensor), or the same on every shard (the whole tensor's).
  enum class RowShardState { elements, rows, whole };
  virtual RowShardState row_shard_state(const std::string& /*name*/, const Shape& /*global*/,
                                        int64_t /*run*/, int64_t /*run_first*/) const {
    return RowShardState::elements;
  }
  // The optimizer's name in messages ("AdamW").
  const std::string& kind() const { return kind_; }

  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  // Sets every group's learning rate (schedules call this before each step).
  void set_lr(double lr);
  // Sets group g's learning rate only.
  void set_group_lr(size_t g, double lr);
  // Parameters over all groups, in group order: the "global index" of state-dict keys.
  int64_t num_params() const { return static_cast<int64_t>(state_.size()); }
  // Steps taken by the parameter with global index i (0 before its first step).
  int64_t step_count(int64_t i) const;
  // The state tensors of parameter i by name ("exp_avg", "master", ...); empty before its
  // first step.
  const std::map<std::string, Tensor>& state(int64_t i) const;
  // Bytes of every state tensor (moments, statistics, master copies) this optimizer holds.
  int64_t state_bytes() const;

  // Everything needed to resume, as tensors (scalars 0-d f64 / i64), so the dict can be
  // written to a safetensors file as is:
  //   state.<i>.step (i64), state.<i>.<name> for each state tensor of param i (only params
  //   that have stepped), group.<g>.lr, group.<g>.weight_decay (f64), group.<g>.params (i64
  //   [n]: the global indices of the group's params), hparam.<name> (f64: betas, eps,
  //   momentum, ...). Values are copies: training on does not change a dict already taken.
  StateDict state_dict() const;
  // Restores a state_dict() of an optimizer of the same kind over parameters of the same
  // shapes. Validates everything first (Error naming the key on a missing or unexpected
  // key, and both shapes/dtypes on a mismatch) and changes nothing if it throws. Values are
  // copied, so resuming continues bitwise as the uninterrupted run would. Hyperparameters
  // (hparam.*, group lr and weight_decay) are taken from the dict, as in PyTorch.
  void load_state_dict(const StateDict& dict);

 protected:
  // A fusing step() reads the pending scale first and drops it with take_grad_scale() once
  // every update has run: a step that throws leaves it pending (as with any step that fails
  // partway, the buckets already updated are not rolled back).
  double take_grad_scale() {
    const double s = grad_scale_;
    grad_scale_ = 1.0;
    return s;
  }
  struct ParamState {
    int64_t step = 0;
    std::map<std::string, Tensor> tensors;
  };
  struct StateSpec {
    std::string name;
    Shape shape;
    DType dtype;
  };

  // `kind` names the optimizer in errors ("AdamW"); groups inherit default_lr /
  // default_weight_decay where they hold ParamGroup::kInherit.
  Optimizer(std::string kind, std::vector<ParamGroup> groups, double default_lr,
            double default_weight_decay);

  // The state tensors a parameter has once it has stepped.
  virtual std::vector<StateSpec> state_specs(const Tensor& param) const = 0;
  // Optimizer-wide hyperparameters (saved as hparam.<name>); set_ validates all of them
  // (Error naming the optimizer and the value) before changing any.
  virtual std::map<std::string, double> hyperparameters() const = 0;
  virtual void set_hyperparameters(const std::map<std::string, double>& values) = 0;
  // Hyperparameters added after state dicts were first saved, with the value an older dict
  // (which lacks the key) stands for; load_state_dict takes that value for a missing one.
  virtual std::map<std::string, double> hyperparameters_before() const { return {}; }
  // Checks one group's lr and weight decay (Error naming the optimizer and the value).
  void check_group_values(double lr, double weight_decay) const;

  // One parameter due for an update: its global index, group, gradient and state.
  struct Pending {
    int64_t index;
    const ParamGroup* group;
    Tensor param, grad;
    ParamState* state;
  };
  // The most tuples one multi-tensor update call takes (call_update's limit).
  static constexpr size_t kMaxTuplesPerCall = 256;

  // Multi-tensor stepping: the parameters that have a gradient (state created by
  // init(param) before their first step) are bucketed by (group, step count, device, dtype,
  // state names), at most kMaxTuplesPerCall per bucket, and update(group, bucket) runs once
  // per bucket: it issues one fused call for the whole bucket and advances their steps.
  // The fused calls validate everything before writing anything, so when one throws Error
  // the bucket is retried one parameter at a time and the error names the parameter (index
  // and name) that fails, as a per-parameter loop would.
  template <typename Init, typename Update>
  void for_each_bucket_with_grad(Init&& init, Update&& update);

  // Runs the in-place update `op` (adamw_, sgd_) in its multi-tensor form on `inputs`:
  // consecutive tuples of `width` tensors (at most kMaxTuplesPerCall), the tensors at
  // positions `written` of every tuple being written (their storage versions are bumped).
  static void call_update(OpId op, std::vector<Tensor> inputs, const Attrs& attrs, size_t width,
                          std::initializer_list<size_t> written);

  // The row shard a parameter is (null: a whole tensor).
  const RowShard* row_shard(const Tensor& param) const {
    auto it = row_shards_.find(param.impl());
    return it == row_shards_.end() ? nullptr : &it->second;
  }

  const std::string kind_;
  std::vector<ParamGroup> groups_;
  std::vector<ParamState> state_;  // by global index
  std::map<const TensorImpl*, RowShard> row_shards_;

 private:
  std::string describe_param(int64_t i) const;

  double grad_scale_ = 1.0;
};

template <typename Init, typename Update>
void Optimizer::for_each_bucket_with_grad(Init&& init, Update&& update) {
  struct Bucket {
    size_t group;
    std::vector<Pending> items;
  };
  auto same_names = [](const std::map<std::string, Tensor>& a,
                       const std::map<std::string, Tensor>& b) {
    return a.size() == b.size() &&
           std::equal(a.begin(), a.end(), b.begin(),
                      [](const auto& x, const auto& y) { return x.first == y.first; });
  };
  std::vector<Bucket> buckets;
  std::vector<size_t> open;  // buckets that can take more items
  int64_t i = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (const Tensor& p : groups_[g].params) {
      Pending item{i, &groups_[g], p, p.grad(), &state_[i]};
      ++i;
      if (!item.grad.defined()) continue;
      if (item.state->step == 0) {
        try {
          item.state->tensors = init(p);
        } catch (const Error& e) {
          fail("{}.step: {}: {}", kind_, describe_param(item.index), e.what());
        }
      }
      auto fits = [&](size_t b) {
        const Pending& first = buckets[b].items.front();
        return buckets[b].group == g && first.state->step == item.state->step &&
               first.param.device() == p.device() && first.param.dtype() == p.dtype() &&
               same_names(first.state->tensors, item.state->tensors);
      };
      size_t k = 0;
      while (k < open.size() && !fits(open[k])) ++k;
      if (k == open.size()) {
        open.push_back(buckets.size());
        buckets.push_back({g, {}});
      }
      std::vector<Pending>& items = buckets[open[k]].items;
      items.push_back(std::move(item));
      if (items.size() == kMaxTuplesPerCall) open.erase(open.begin() + static_cast<ptrdiff_t>(k));
    }
  }
  for (const Bucket& b : buckets) {
    const ParamGroup& group = groups_[b.group];
    try {
      update(group, std::span<const Pending>(b.items));
    } catch (const Error& e) {
      if (b.items.size() == 1) {
        fail("{}.step: {}: {}", kind_, describe_param(b.items[0].index), e.what());
      }
      for (const Pending& item : b.items) {
        try {
          update(group, std::span<const Pending>(&item, 1));
        } catch (const Error& e1) {
          fail("{}.step: {}: {}", kind_, describe_param(item.index), e1.what());
        }
      }
    }
  }
}

}  // namespace tessera::optim
