// Mixture of Experts (GShard, Switch Transformer, Mixtral, DeepSeek-V3): a router picks k of E
// feed-forward experts for every token and the token's output is their outputs weighted by
// the router's scores. Written with ops (no backward code): the router's linear layer in f32,
// softmax or sigmoid scores, topk, the tokens grouped by expert (counting_sort) and the
// experts run as two grouped matmuls over the sorted rows, then scattered back (index_add)
// weighted by their gates.
//
//   nn::MoeOptions o;  o.experts = 8;  o.top_k = 2;  o.aux_loss = 0.01;
//   auto moe = std::make_shared<nn::MixtureOfExperts>(/*width=*/128, o);
//   Tensor y = moe->forward(x);            // x [..., 128] -> [..., 128]
//
// Dropless by default (every token reaches its k experts); with a capacity factor each of
// `groups` contiguous groups of tokens sends at most ceil(tokens_per_group * k * factor / E)
// tokens to an expert, by position or by score, and a dropped token's slot adds nothing (in a
// residual block the token passes through). The Switch/GShard balancing loss alpha * E *
// sum_i f_i P_i (f_i: the fraction of the k * N assignments routed to expert i, counted before
// dropping and without gradient; P_i: the mean router probability of expert i) and the
// router z-loss (ST-MoE: the mean squared logsumexp of the router logits) are attached to the
// output (autograd/aux_loss.h), so they train wherever the layer runs. Counts are those of
// every rank that shares the batch when a `MoeCountReduction` is installed (the data-parallel
// group): the aux loss is then the single-device value, not a per-rank one. DeepSeek-V3's
// aux-loss-free balancing adds a per-expert bias to the scores for selection only, moved by
// +-rate against each expert's load after every step (`update_selection_bias`).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"

namespace tessera::nn {

struct MoeOptions {
  int64_t experts = 8;  // E
  int64_t top_k = 2;    // k experts per token
  int64_t hidden = 0;   // each expert's FFN width (0: 4 x the model width)
  enum class Score { softmax, sigmoid };
  Score score = Score::softmax;
  bool renormalize = true;       // the k gates divided by their sum (top_k > 1)
  double capacity_factor = 0.0;  // 0: dropless
  enum class DropPolicy { position, score };
  DropPolicy drop_policy = DropPolicy::position;
  // Capacity groups the batch's tokens are split into (contiguous); a forward that runs a
  // part of the batch (MoeBatchParts) takes its share of them.
  int64_t groups = 1;
  double aux_loss = 0.0;         // alpha of the balancing loss
  double z_loss = 0.0;           // coefficient of the router z-loss
  double bias_rate = 0.0;        // aux-loss-free balancing: the bias step (0: off)
  // Throws tessera::Error naming the field and its value.
  void validate(int64_t width) const;
  int64_t hidden_for(int64_t width) const { return hidden > 0 ? hidden : 4 * width; }
};

// The layer's tensors, by role (a module's own, or a model's parameters by path).
struct MoeWeights {
  Tensor router;          // [E, C] (as a Linear's weight, no bias)
  Tensor fc_weight;       // [E, C, H]
  Tensor fc_bias;         // [E, H]
  Tensor proj_weight;     // [E, H, C]
  Tensor proj_bias;       // [E, C]
  Tensor selection_bias;  // [E] f32, no gradient (aux-loss-free balancing); may be undefined
  // When set, runs the experts in place of the layer's own two grouped matmuls over the
  // tensors above (a tensor-parallel wrapper splits each expert's hidden width over its
  // ranks there: expert tensor parallelism).
  std::function<Tensor(const Tensor& rows, const std::vector<int64_t>& sizes, int64_t first)> experts =
      nullptr;
  // The first expert fc_* and proj_* hold, checked against the dispatch's when they hold
  // some of them (-1: not known, as for a model's parameters by path).
  int64_t first_expert = -1;
};

// What one forward saw, over every rank that shares the batch (see MoeCountReduction).
struct MoeLayerStats {
  std::string name;
  std::vector<int64_t> counts;  // assignments routed to each expert, before capacity drops
  int64_t tokens = 0;           // tokens routed
  int64_t dropped = 0;          // assignments dropped by the capacity
  double aux_loss = 0.0;        // alpha * E * sum f_i P_i (0 when alpha is 0)
  double z_loss = 0.0;          // coefficient * mean lse^2
  // max over experts of counts / their mean (1: perfectly balanced).
  double imbalance() const;
};

// Collects the stats of every forward on this thread while alive (innermost scope); a
// checkpoint's recomputation in backward records nothing.
class MoeStatsScope {
 public:
  MoeStatsScope();
  ~MoeStatsScope();
  MoeStatsScope(const MoeStatsScope&) = delete;
  MoeStatsScope& operator=(const MoeStatsScope&) = delete;
  const std::vector<MoeLayerStats>& layers() const { return layers_; }
  void add(MoeLayerStats s) { layers_.push_back(std::move(s)); }

 private:
  std::vector<MoeLayerStats> layers_;
  MoeStatsScope* previous_;
};

// Sums a small f64 tensor over every rank that shares the batch, in place (data parallelism
// installs an all-reduce over its group). Installed per thread while alive; the layer calls
// it once per forward, also when recomputation reruns the forward in backward, so every
// rank must run the same forwards.
class MoeCountReduction {
 public:
  explicit MoeCountReduction(std::function<void(Tensor&)> sum);
  ~MoeCountReduction();
  MoeCountReduction(const MoeCountReduction&) = delete;
  MoeCountReduction& operator=(const MoeCountReduction&) = delete;

 private:
  std::function<void(Tensor&)> sum_;
  MoeCountReduction* previous_;
  friend void reduce_moe_counts(Tensor& t);
};
void reduce_moe_counts(Tensor& t);

// The counts a step's forwards use for the balancing loss's f_i instead of their own: the
// whole step's, from a routing pass over all its micro-batches (forwards without grad),
// summed by layer name. With gradient accumulation each micro-batch's balancing loss then
// has one device's f_i (the whole batch's), so the step's gradient is one device's.
// Installed per thread while alive.
class MoeStepCounts {
 public:
  struct Counts {
    std::vector<int64_t> counts;
    int64_t tokens = 0;
  };
  // Every forward the routing pass recorded (each micro-batch's, over the ranks sharing it).
  explicit MoeStepCounts(const std::vector<MoeLayerStats>& step);
  ~MoeStepCounts();
  MoeStepCounts(const MoeStepCounts&) = delete;
  MoeStepCounts& operator=(const MoeStepCounts&) = delete;
  const Counts* find(const std::string& name) const;  // null: not recorded

 private:
  std::map<std::string, Counts> counts_;
  MoeStepCounts* previous_;
};

// This thread's forwards each run 1/parts of the batch (data-parallel ranks x micro-
// batches): a capacity's groups are the batch's, so each forward cuts its tokens into
// groups / parts of them (groups must divide), and tokens drop as on one device. Installed
// while alive.
class MoeBatchParts {
 public:
  explicit MoeBatchParts(int64_t parts);
  ~MoeBatchParts();
  MoeBatchParts(const MoeBatchParts&) = delete;
  MoeBatchParts& operator=(const MoeBatchParts&) = delete;

 private:
  int64_t previous_;
};

// Each row's expert (0, 1, ...) for rows grouped by expert, sizes[j] rows of expert j.
std::vector<int64_t> row_experts(const std::vector<int64_t>& sizes);

// Runs experts [first, first + sizes.size()) over rows grouped by expert (sizes[j] rows of
// expert first + j, in order): their outputs, row for row.
using ExpertsFn =
    std::function<Tensor(const Tensor& rows, const std::vector<int64_t>& sizes, int64_t first)>;

// Where the experts run. Without one installed, every expert runs here; expert parallelism
// (parallel/expert_parallel.h) sends each expert's rows to the rank holding it and the
// outputs back. rows [R, C] are grouped by expert over all E experts (sizes [E]); the result
// is each row's expert output, in the same order.
class MoeDispatch {
 public:
  virtual ~MoeDispatch() = default;
  virtual Tensor run(const Tensor& rows, const std::vector<int64_t>& sizes, const ExpertsFn& experts) = 0;
  // The experts [first, first + count) that run here: a layer holding only some experts
  // holds these.
  virtual std::pair<int64_t, int64_t> local_experts() const = 0;
};
// Installs `dispatch` for this thread's forwards while alive (innermost wins; null: local).
class MoeDispatchScope {
 public:
  explicit MoeDispatchScope(MoeDispatch* dispatch);
  ~MoeDispatchScope();
  MoeDispatchScope(const MoeDispatchScope&) = delete;
  MoeDispatchScope& operator=(const MoeDispatchScope&) = delete;

 private:
  MoeDispatch* previous_;
};

// While alive, every MixtureOfExperts constructed on this thread holds experts [first,
// first + count) only, with one device's initial values (the generator's draws for the other
// experts are skipped, not made; it ends where building them all would leave it): expert
// parallelism without the whole layer in memory first. Innermost wins.
class MoeBuildScope {
 public:
  MoeBuildScope(int64_t first, int64_t count);
  ~MoeBuildScope();
  MoeBuildScope(const MoeBuildScope&) = delete;
  MoeBuildScope& operator=(const MoeBuildScope&) = delete;

 private:
  std::pair<int64_t, int64_t> previous_;
};

// The layer as a function: x [N, C] -> [N, C] (the k experts' outputs weighted by their
// gates; the attached auxiliary losses). `name` labels its stats and keys the step's counts:
// each MoE layer of a model needs its own.
Tensor moe_forward(const MoeOptions& o, const MoeWeights& w, const Tensor& x, const std::string& name);

// DeepSeek-V3's bias update: b_i += rate * sign(mean(counts) - counts_i), in place.
void update_selection_bias(Tensor& bias, const std::vector<int64_t>& counts, double rate);

// Parameters router [E, C], fc_weight [E, C, H], fc_bias [E, H], proj_weight
// [E, H, C], proj_bias [E, C]; with bias_rate > 0 the buffer selection_bias [E] (f32, zero
// at first). Initialised as torch's Linear per expert (U(-1/sqrt(in), 1/sqrt(in))), biases
// zero. Under expert parallelism a rank may keep only the experts it runs (keep_experts):
// its fc_* and proj_* then hold those, and moe_forward takes them for the dispatch's
// local_experts().
class MixtureOfExperts : public Module {
 public:
  // `name` labels its routing statistics and keys the step's counts (MoeStepCounts): every
  // MoE layer of a model needs its own.
  MixtureOfExperts(int64_t width, MoeOptions options, std::string name = "moe",
                   DType dtype = DType::f32);
  // x [..., C] -> [..., C].
  Tensor forward(const Tensor& x) override;
  MoeWeights weights() const;
  // Keeps experts [first, first + count) only (their parameters become copies of those
  // rows; the router stays whole): the experts this rank runs under expert parallelism.
  // Before the optimizer and any data-parallel wrapper see the parameters.
  // (Nothing when it holds exactly those already: built under a MoeBuildScope.)
  void keep_experts(int64_t first, int64_t count);
  // Runs `init` (one draw of each element from this thread's generator, as nn::init's do) on
  // an expert tensor `t` of this layer ([experts held, ...]), giving the held experts what
  // the draw for all E would give them; the generator ends where that draw leaves it.
  void init_experts(Tensor& t, const std::function<void(Tensor&)>& init) const;
  MoeOptions options;
  std::string name;
  int64_t first_expert = 0;  // the first expert its fc_* and proj_* hold
  Tensor router, fc_weight, fc_bias, proj_weight, proj_bias, selection_bias;

 private:
  // init_experts' draw on `t` ([held, ...]), unchecked (the constructor's, before fc_weight).
  void draw_experts(Tensor& t, const std::function<void(Tensor&)>& init) const;
};

}  // namespace tessera::nn
