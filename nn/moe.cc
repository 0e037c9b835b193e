#include "nn/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "autograd/aux_loss.h"
#include "autograd/checkpoint.h"
#include "nn/init.h"
#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/random.h"
#include "tensor/ops.h"

namespace tessera::nn {
namespace {

thread_local MoeStatsScope* t_stats = nullptr;
thread_local MoeCountReduction* t_reduction = nullptr;
thread_local MoeDispatch* t_dispatch = nullptr;
thread_local MoeStepCounts* t_step_counts = nullptr;
thread_local int64_t t_parts = 1;
thread_local std::pair<int64_t, int64_t> t_build = {0, 0};  // (first, count); count 0: all

// Which expert rows the experts run, in order: each expert's rows together (expert 0's
// first), within an expert by capacity group, within a group by position or score.
struct RoutingPlan {
  std::vector<int64_t> assignment;  // row -> assignment t * k + slot
  std::vector<int64_t> sizes;       // rows per expert
  std::vector<int64_t> counts;      // assignments per expert before capacity drops
  int64_t dropped = 0;
};

RoutingPlan plan_routing(const MoeOptions& o, const std::vector<int64_t>& expert_of,
                         const std::vector<double>& gate_of, int64_t tokens) {
  const int64_t E = o.experts, k = o.top_k;
  const bool capped = o.capacity_factor > 0;
  int64_t groups = capped ? o.groups : 1;
  if (capped && t_parts > 1) {
    TS_CHECK(o.groups % t_parts == 0,
             "MixtureOfExperts: groups = {} capacity groups over the whole batch do not divide among "
             "the {} forwards it is split into (ranks x micro-batches)", o.groups, t_parts);
    groups = o.groups / t_parts;
  }
  TS_CHECK(tokens % groups == 0,
           "MixtureOfExperts: {} tokens do not split into groups = {} capacity groups", tokens, groups);
  const int64_t per_group = tokens / groups;
  // Bucket (group, expert) of every assignment, sorted stably: each bucket in position order.
  std::vector<int64_t> keys(expert_of.size());
  for (size_t a = 0; a < keys.size(); ++a) {
    keys[a] = (static_cast<int64_t>(a) / k / per_group) * E + expert_of[a];
  }
  const std::vector<Tensor> sorted = counting_sort(
      Tensor::from_vector(keys, {static_cast<int64_t>(keys.size())}), groups * E);
  const std::vector<int64_t> order = sorted[0].to_vector<int64_t>();
  const std::vector<int64_t> bucket_size = sorted[1].to_vector<int64_t>();
  std::vector<int64_t> bucket_start(bucket_size.size() + 1, 0);
  for (size_t b = 0; b < bucket_size.size(); ++b) bucket_start[b + 1] = bucket_start[b] + bucket_size[b];

  const int64_t capacity =
      capped ? static_cast<int64_t>(std::ceil(static_cast<double>(per_group * k) * o.capacity_factor /
                                              static_cast<double>(E)))
             : std::numeric_limits<int64_t>::max();
  RoutingPlan p;
  p.sizes.assign(E, 0);
  p.counts.assign(E, 0);
  p.assignment.reserve(expert_of.size());
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t b = g * E + e;
      std::vector<int64_t> bucket(order.begin() + bucket_start[b], order.begin() + bucket_start[b + 1]);
      p.counts[e] += static_cast<int64_t>(bucket.size());
      if (static_cast<int64_t>(bucket.size()) > capacity) {
        if (o.drop_policy == MoeOptions::DropPolicy::score) {
          std::stable_sort(bucket.begin(), bucket.end(),
                           [&](int64_t a1, int64_t a2) { return gate_of[a1] > gate_of[a2]; });
        }
        p.dropped += static_cast<int64_t>(bucket.size()) - capacity;
        bucket.resize(capacity);
        // The kept ones run in position order whatever chose them.
        std::sort(bucket.begin(), bucket.end());
      }
      p.sizes[e] += static_cast<int64_t>(bucket.size());
      p.assignment.insert(p.assignment.end(), bucket.begin(), bucket.end());
    }
  }
  return p;
}

Tensor index_tensor(const std::vector<int64_t>& v, Device device) {
  return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}).to(device);
}

}  // namespace

void MoeOptions::validate(int64_t width) const {
  TS_CHECK(experts >= 1, "MixtureOfExperts: experts must be >= 1, got {}", experts);
  TS_CHECK(top_k >= 1 && top_k <= experts, "MixtureOfExperts: top_k = {} must be in [1, experts = {}]",
           top_k, experts);
  TS_CHECK(hidden >= 0, "MixtureOfExperts: hidden must be >= 0 (0: 4 x width), got {}", hidden);
  TS_CHECK(width >= 1, "MixtureOfExperts: width must be >= 1, got {}", width);
  TS_CHECK(capacity_factor >= 0 && std::isfinite(capacity_factor),
           "MixtureOfExperts: capacity_factor must be >= 0 (0: dropless), got {}", capacity_factor);
  TS_CHECK(groups >= 1, "MixtureOfExperts: groups must be >= 1, got {}", groups);
  TS_CHECK(aux_loss >= 0 && std::isfinite(aux_loss), "MixtureOfExperts: aux_loss must be >= 0, got {}",
           aux_loss);
  TS_CHECK(z_loss >= 0 && std::isfinite(z_loss), "MixtureOfExperts: z_loss must be >= 0, got {}", z_loss);
  TS_CHECK(bias_rate >= 0 && std::isfinite(bias_rate),
           "MixtureOfExperts: bias_rate must be >= 0, got {}", bias_rate);
}

double MoeLayerStats::imbalance() const {
  int64_t total = 0, most = 0;
  for (int64_t c : counts) {
    total += c;
    most = std::max(most, c);
  }
  if (total == 0) return 1.0;
  return static_cast<double>(most) * static_cast<double>(counts.size()) / static_cast<double>(total);
}

MoeStatsScope::MoeStatsScope() : previous_(t_stats) { t_stats = this; }
MoeStatsScope::~MoeStatsScope() { t_stats = previous_; }

MoeCountReduction::MoeCountReduction(std::function<void(Tensor&)> sum)
    : sum_(std::move(sum)), previous_(t_reduction) {
  t_reduction = this;
}
MoeCountReduction::~MoeCountReduction() { t_reduction = previous_; }

MoeStepCounts::MoeStepCounts(const std::vector<MoeLayerStats>& step) : previous_(t_step_counts) {
  for (const MoeLayerStats& s : step) {
    Counts& c = counts_[s.name];
    if (c.counts.empty()) c.counts.assign(s.counts.size(), 0);
    TS_CHECK(c.counts.size() == s.counts.size(), "MoeStepCounts: layer '{}' with {} and {} experts",
             s.name, c.counts.size(), s.counts.size());
    for (size_t e = 0; e < s.counts.size(); ++e) c.counts[e] += s.counts[e];
    c.tokens += s.tokens;
  }
  t_step_counts = this;
}
MoeStepCounts::~MoeStepCounts() { t_step_counts = previous_; }
const MoeStepCounts::Counts* MoeStepCounts::find(const std::string& name) const {
  auto it = counts_.find(name);
  return it != counts_.end() ? &it->second : nullptr;
}

MoeBatchParts::MoeBatchParts(int64_t parts) : previous_(t_parts) {
  TS_CHECK(parts >= 1, "MoeBatchParts: parts must be >= 1, got {}", parts);
  t_parts = parts;
}
MoeBatchParts::~MoeBatchParts() { t_parts = previous_; }

MoeDispatchScope::MoeDispatchScope(MoeDispatch* dispatch) : previous_(t_dispatch) { t_dispatch = dispatch; }
MoeDispatchScope::~MoeDispatchScope() { t_dispatch = previous_; }

void reduce_moe_counts(Tensor& t) {
  if (t_reduction != nullptr && t_reduction->sum_) t_reduction->sum_(t);
}

Tensor moe_forward(const MoeOptions& o, const MoeWeights& w, const Tensor& x, const std::string& name) {
  const int64_t E = o.experts, k = o.top_k;
  TS_CHECK(x.defined() && x.dim() == 2 && w.router.defined() && w.router.dim() == 2 &&
               w.router.size(0) == E && x.size(1) == w.router.size(1),
           "MixtureOfExperts '{}': expected x [N, C] and a router [{}, C], got {} and {}", name, E,
           x.defined() ? shape_str(x.shape()) : std::string("undefined"),
           w.router.defined() ? shape_str(w.router.shape()) : std::string("undefined"));
  const int64_t N = x.size(0), C = x.size(1);
  const Device device = x.device();

  // The router in f32 (f64 stays f64), whatever autocast or the model's dtype.
  Tensor logits, scores, balance_probs;
  {
    const AutocastGuard full_precision(DType::f32);
    const DType rdt = x.dtype() == DType::f64 ? DType::f64 : DType::f32;
    const Tensor xr = x.dtype() == rdt ? x : cast(x, rdt);
    const Tensor wr = w.router.dtype() == rdt ? w.router : cast(w.router, rdt);
    logits = matmul(xr, transpose(wr, 0, 1));  // [N, E]
    if (o.score == MoeOptions::Score::softmax) {
      scores = softmax(logits, 1);
      balance_probs = scores;
    } else {
      scores = sigmoid(logits);
      balance_probs = scores / sum(scores, {1}, /*keepdim=*/true);
    }
  }
  // Selection may add the balancing bias; the gates are the unbiased scores.
  Tensor select = scores.detach();
  if (w.selection_bias.defined()) select = select + cast(w.selection_bias, select.dtype());
  const Tensor chosen = topk(select, k, 1)[1];  // [N, k] i64
  Tensor gates = gather(scores, 1, chosen);     // [N, k]
  if (o.renormalize && k > 1) gates = gates / sum(gates, {1}, /*keepdim=*/true);

  const std::vector<int64_t> expert_of = chosen.to_vector<int64_t>();
  std::vector<double> gate_of;
  if (o.capacity_factor > 0 && o.drop_policy == MoeOptions::DropPolicy::score) {
    gate_of = gates.to_vector<double>();
  }
  const RoutingPlan plan = plan_routing(o, expert_of, gate_of, N);

  // The experts over their rows (here, or where a dispatch sends them), then each row back
  // to its token, weighted by its gate.
  std::vector<int64_t> token_rows(plan.assignment.size());
  for (size_t r = 0; r < plan.assignment.size(); ++r) token_rows[r] = plan.assignment[r] / k;
  const Tensor tokens = index_tensor(token_rows, device);
  // The experts the layer's tensors hold: all E, or (expert parallelism) the dispatch's.
  const int64_t held = w.fc_weight.size(0);
  int64_t held_first = 0;
  if (held != E) {
    TS_CHECK(t_dispatch != nullptr && t_dispatch->local_experts().second == held,
             "MixtureOfExperts '{}': its tensors hold {} of the {} experts; run it under the "
             "expert-parallel dispatch that runs those here (it runs {})", name, held, E,
             t_dispatch != nullptr ? fmt::format("{}", t_dispatch->local_experts().second)
                                   : std::string("none: no dispatch installed"));
    held_first = t_dispatch->local_experts().first;
    TS_CHECK(w.first_expert < 0 || w.first_expert == held_first,
             "MixtureOfExperts '{}': holds experts [{}, {}) but the dispatch runs [{}, {}) here", name,
             w.first_expert, w.first_expert + held, held_first, held_first + held);
  }
  const ExpertsFn here = [&](const Tensor& rows, const std::vector<int64_t>& sizes, int64_t first) {
    const int64_t n = static_cast<int64_t>(sizes.size());
    TS_CHECK(first >= held_first && first + n <= held_first + held,
             "MixtureOfExperts '{}': experts [{}, {}) of {}, but this layer holds [{}, {})", name,
             first, first + n, E, held_first, held_first + held);
    // The weights of experts [first, first + n): views of the layer's tensors.
    const auto mine = [&](const Tensor& t) {
      return n == held ? t : slice(t, 0, first - held_first, first - held_first + n);
    };
    const Tensor ids = index_tensor(row_experts(sizes), rows.device());
    const Tensor counts = index_tensor(sizes, rows.device());
    const Tensor h = gelu(grouped_matmul(rows, mine(w.fc_weight), counts) + index_select(mine(w.fc_bias), 0, ids),
                          /*approximate_tanh=*/true);
    return grouped_matmul(h, mine(w.proj_weight), counts) + index_select(mine(w.proj_bias), 0, ids);
  };
  const ExpertsFn& experts = w.experts ? w.experts : here;
  const Tensor xs = index_select(x, 0, tokens);  // [R, C], grouped by expert
  Tensor y = t_dispatch != nullptr ? t_dispatch->run(xs, plan.sizes, experts) : experts(xs, plan.sizes, 0);
  const Tensor row_gates = index_select(view(gates, {N * k}), 0, index_tensor(plan.assignment, device));
  y = y * unsqueeze(row_gates, 1);
  Tensor out = index_add(zeros({N, C}, y.dtype(), device), 0, tokens, y);
  if (out.dtype() != x.dtype()) out = cast(out, x.dtype());

  // Counts, probability sums and z sums over every rank sharing the batch: one all-reduce.
  const bool z_on = o.z_loss > 0;
  Tensor lse_sq;
  if (z_on) {
    const AutocastGuard full_precision(DType::f32);
    const Tensor m = max(logits, {1}, /*keepdim=*/true).detach();
    const Tensor lse = log(sum(exp(logits - m), {1})) + squeeze(m, {1});
    lse_sq = lse * lse;
  }
  const Tensor psum = sum(balance_probs, {0});  // [E]
  std::vector<double> shared(2 * E + 3, 0.0);
  const std::vector<double> psum_local = psum.to_vector<double>();
  for (int64_t e = 0; e < E; ++e) {
    shared[e] = static_cast<double>(plan.counts[e]);
    shared[E + e] = psum_local[e];
  }
  shared[2 * E] = static_cast<double>(N);
  shared[2 * E + 1] = z_on ? sum(lse_sq).item<double>() : 0.0;
  shared[2 * E + 2] = static_cast<double>(plan.dropped);
  // On the layer's device: a device communicator (NCCL) takes device tensors only.
  Tensor reduced = Tensor::from_vector(shared, {2 * E + 3}).to(device);
  reduce_moe_counts(reduced);
  const std::vector<double> all = reduced.to_vector<double>();
  const double tokens_all = all[2 * E];

  MoeLayerStats stats;
  stats.name = name;
  stats.tokens = static_cast<int64_t>(tokens_all);
  stats.dropped = static_cast<int64_t>(all[2 * E + 2]);
  // f_i: from the step's counts when a routing pass gave them (accumulation: the whole
  // batch's, as one device's), else from this forward's (over the ranks sharing it).
  const MoeStepCounts::Counts* step = t_step_counts != nullptr ? t_step_counts->find(name) : nullptr;
  TS_CHECK(step == nullptr || static_cast<int64_t>(step->counts.size()) == E,
           "MixtureOfExperts '{}': the step's counts hold {} experts, the layer {}", name,
           step != nullptr ? step->counts.size() : 0, E);
  std::vector<double> fraction(E);
  for (int64_t e = 0; e < E; ++e) {
    stats.counts.push_back(static_cast<int64_t>(all[e]));
    if (step != nullptr) {
      fraction[e] = step->tokens > 0 ? static_cast<double>(step->counts[e]) /
                                           (static_cast<double>(step->tokens) * static_cast<double>(k))
                                     : 0.0;
    } else {
      fraction[e] = tokens_all > 0 ? all[e] / (tokens_all * static_cast<double>(k)) : 0.0;
    }
    stats.aux_loss += o.aux_loss * static_cast<double>(E) * fraction[e] *
                      (tokens_all > 0 ? all[E + e] / tokens_all : 0.0);
  }
  stats.z_loss = z_on && tokens_all > 0 ? o.z_loss * all[2 * E + 1] / tokens_all : 0.0;

  // This rank's share, as its loss is its own tokens' mean: alpha E sum f_i (its P_i).
  Tensor aux;
  if (o.aux_loss > 0 && N > 0) {
    const Tensor f = Tensor::from_vector(fraction, {E}).to(device);
    aux = sum(cast(f, psum.dtype()) * psum) * (o.aux_loss * static_cast<double>(E) / static_cast<double>(N));
  }
  if (z_on && N > 0) {
    const Tensor z = sum(lse_sq) * (o.z_loss / static_cast<double>(N));
    aux = aux.defined() ? aux + z : z;
  }
  if (aux.defined()) out = autograd::attach_loss(out, aux);
  if (t_stats != nullptr && !autograd::recomputing()) t_stats->add(std::move(stats));
  return out;
}

void update_selection_bias(Tensor& bias, const std::vector<int64_t>& counts, double rate) {
  TS_CHECK(bias.defined() && bias.dim() == 1 && bias.size(0) == static_cast<int64_t>(counts.size()),
           "update_selection_bias: bias {} for {} experts' counts",
           bias.defined() ? shape_str(bias.shape()) : std::string("undefined"), counts.size());
  double mean = 0;
  for (int64_t c : counts) mean += static_cast<double>(c);
  mean /= static_cast<double>(std::max<size_t>(counts.size(), 1));
  std::vector<double> b = bias.to_vector<double>();
  for (size_t e = 0; e < counts.size(); ++e) {
    const double err = mean - static_cast<double>(counts[e]);
    b[e] += rate * static_cast<double>((err > 0) - (err < 0));
  }
  const NoGradGuard no_grad;
  bias.copy_(Tensor::from_vector(b, {static_cast<int64_t>(b.size())}).to(bias.device()));
}

std::vector<int64_t> row_experts(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> out;
  for (size_t j = 0; j < sizes.size(); ++j) out.insert(out.end(), sizes[j], static_cast<int64_t>(j));
  return out;
}

MoeBuildScope::MoeBuildScope(int64_t first, int64_t count) : previous_(t_build) {
  TS_CHECK(first >= 0 && count >= 1, "MoeBuildScope: experts [{}, {} + {}) is not a range", first,
           first, count);
  t_build = {first, count};
}
MoeBuildScope::~MoeBuildScope() { t_build = previous_; }

MixtureOfExperts::MixtureOfExperts(int64_t width, MoeOptions o, std::string name, DType dtype)
    : Module("MixtureOfExperts"), options(o), name(std::move(name)) {
  options.validate(width);
  const int64_t E = options.experts, H = options.hidden_for(width);
  // (Plain variables, not a structured binding: lambdas capture them; clang < 16 rejects that.)
  const std::pair<int64_t, int64_t> range = t_build.second > 0 ? t_build : std::pair<int64_t, int64_t>{0, E};
  const int64_t first = range.first, held = range.second;
  TS_CHECK(first + held <= E, "MixtureOfExperts '{}': built with experts [{}, {}) of its {}",
           this->name, first, first + held, E);
  first_expert = first;
  // Per expert as torch's Linear(in, out): U(-1/sqrt(in), 1/sqrt(in)) for weights.
  const auto uniform = [dtype](Shape s, int64_t in) {
    Tensor t = Tensor::empty(std::move(s), dtype);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    init::uniform_(t, -bound, bound);
    return t;
  };
  const auto experts_uniform = [&](Shape per_expert, int64_t in) {
    per_expert.insert(per_expert.begin(), held);
    Tensor t = Tensor::empty(std::move(per_expert), dtype);
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    draw_experts(t, [&](Tensor& x) { init::uniform_(x, -bound, bound); });
    return t;
  };
  router = register_parameter("router", uniform({E, width}, width));
  fc_weight = register_parameter("fc_weight", experts_uniform({width, H}, width));
  fc_bias = register_parameter("fc_bias", zeros({held, H}, dtype));
  proj_weight = register_parameter("proj_weight", experts_uniform({H, width}, H));
  proj_bias = register_parameter("proj_bias", zeros({held, width}, dtype));
  if (options.bias_rate > 0) selection_bias = register_buffer("selection_bias", zeros({E}, DType::f32));
}

void MixtureOfExperts::init_experts(Tensor& t, const std::function<void(Tensor&)>& init) const {
  const int64_t held = fc_weight.size(0);
  TS_CHECK(t.defined() && t.dim() >= 1 && t.size(0) == held && t.numel() > 0,
           "MixtureOfExperts '{}': init_experts takes one of its expert tensors ([{}, ...], the "
           "experts it holds), got {}", name, held,
           t.defined() ? shape_str(t.shape()) : std::string("undefined"));
  draw_experts(t, init);
}

void MixtureOfExperts::draw_experts(Tensor& t, const std::function<void(Tensor&)>& init) const {
  // Element i of a draw uses counter offset + i: the held experts' part of the whole [E, ...]
  // draw starts first x (elements per expert) further on.
  const int64_t held = t.size(0);
  Generator& g = default_generator();
  const uint64_t start = g.offset(), each = static_cast<uint64_t>(t.numel() / held);
  const uint64_t end = start + static_cast<uint64_t>(options.experts) * each;
  struct EndsThere {  // the generator ends where the whole draw would, even if init throws
    Generator& g;
    uint64_t end;
    ~EndsThere() { g.set_state(g.seed(), end); }
  } ends{g, end};
  g.set_state(g.seed(), start + static_cast<uint64_t>(first_expert) * each);
  init(t);
  TS_CHECK(g.offset() == start + static_cast<uint64_t>(first_expert + held) * each,
           "MixtureOfExperts '{}': init_experts' function must draw each element once", name);
}

void MixtureOfExperts::keep_experts(int64_t first, int64_t count) {
  const int64_t E = options.experts;
  if (first == first_expert && count == fc_weight.size(0)) return;  // built with just these
  TS_CHECK(fc_weight.size(0) == E,
           "MixtureOfExperts '{}': keep_experts on a layer that holds {} of its {} experts already",
           name, fc_weight.size(0), E);
  TS_CHECK(count >= 1 && first >= 0 && first + count <= E,
           "MixtureOfExperts '{}': keep_experts({}, {}) is not a range of its {} experts", name, first,
           count, E);
  const NoGradGuard no_grad;
  const auto keep = [&](const std::string& what, Tensor& t) {
    t = replace_parameter(what, slice(t, 0, first, first + count).clone());
  };
  keep("fc_weight", fc_weight);
  keep("fc_bias", fc_bias);
  keep("proj_weight", proj_weight);
  keep("proj_bias", proj_bias);
  first_expert = first;
}

MoeWeights MixtureOfExperts::weights() const {
  MoeWeights w{router, fc_weight, fc_bias, proj_weight, proj_bias, selection_bias};
  w.first_expert = first_expert;
  return w;
}

Tensor MixtureOfExperts::forward(const Tensor& x) {
  TS_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == router.size(1),
           "MixtureOfExperts: expected input [..., {}], got {}", router.size(1),
           x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  const Tensor y = moe_forward(options, weights(), reshape(x, {-1, x.size(-1)}), name);
  return reshape(y, x.shape());
}

}  // namespace tessera::nn
