#include "parallel/zero.h"

#include "parallel/zero_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "optim/clip.h"
#include "parallel/comm/comm_log.h"
#include "parallel/data_parallel.h"
#include "parallel/placement.h"
#include "tensor/allocator.h"
#include "tensor/autocast.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {

// ---- construction ------------------------------------------------------------------------

ZeroDataParallel::ZeroDataParallel(nn::Module& module, Communicator& comm, ZeroOptions options)
    : state_(std::make_shared<State>()) {
  TS_CHECK(options.stage >= 0 && options.stage <= 3, "{}: stage must be 0, 1, 2 or 3, got {}",
           kName, options.stage);
  TS_CHECK(options.bucket_bytes > 0, "{}: bucket_bytes must be positive, got {}", kName,
           options.bucket_bytes);
  TS_CHECK(options.block_shards >= 0 && !(options.block_shards > 0 && options.row_shards),
           "{}: block_shards must be >= 0 and not combined with row_shards, got block_shards {} "
           "with row_shards {}",
           kName, options.block_shards, options.row_shards);
  TS_CHECK(!options.comm_hook || options.stage == 0 || options.comm_hook->full_reduction(),
           "{}: comm hook '{}' leaves each rank its own gradient, and stage {} needs every "
           "segment reduced to take its block of it (use stage 0)",
           kName, options.comm_hook ? options.comm_hook->name() : "", options.stage);
  TS_CHECK(options.subgroup.group == nullptr ||
               (!options.comm_hook && !options.row_shards && options.block_shards == 0),
           "{}: parameters reduced over subgroup '{}' take flat shards of plain reductions: not "
           "with a comm hook, row_shards or block_shards (got hook '{}', row_shards {}, "
           "block_shards {})",
           kName, options.subgroup.group != nullptr ? options.subgroup.group->name() : "",
           options.comm_hook ? options.comm_hook->name() : "", options.row_shards,
           options.block_shards);
  State& st = *state_;
  st.module = &module;
  st.comm = &comm;
  st.options = options;

  // Parameters once each (a tied weight is one tensor).
  // Plain variables, not a structured binding: lambdas capture them (clang < 16 rejects that).
  for (auto& entry : module.named_parameters()) {
    const std::string& name = entry.first;
    Tensor& param = entry.second;
    if (!param.requires_grad()) continue;
    const bool seen = std::any_of(st.params.begin(), st.params.end(),
                                  [&](const State::Param& p) { return p.tensor.is_same(param); });
    if (!seen) st.params.push_back({name, param});
  }
  for (State::Param& p : st.params) {
    p.decay = options.decay ? options.decay(p.name, p.tensor)
                            : p.tensor.dim() >= 2;  // optim::decay_groups' rule
    st.numel += p.tensor.numel();
  }

  // Units: each wrapped path, then the root (everything else).
  std::map<const TensorImpl*, int> unit_of;
  for (size_t u = 0; u < options.units.size(); ++u) {
    const std::string& path = options.units[u];
    nn::Module& m = module.submodule(path);
    for (const Tensor& t : m.parameters()) {
      auto [it, inserted] = unit_of.emplace(t.impl(), static_cast<int>(u));
      TS_CHECK(inserted || it->second == static_cast<int>(u),
               "{}: a parameter of unit '{}' also belongs to unit '{}'; units must not share "
               "parameters (leave shared ones to the root)",
               kName, path, options.units[it->second]);
    }
    st.units.push_back({path, &m});
  }
  st.units.push_back({"", &module});
  for (int i = 0; i < static_cast<int>(st.params.size()); ++i) {
    auto it = unit_of.find(st.params[i].tensor.impl());
    st.params[i].unit = it == unit_of.end() ? st.root() : it->second;
    st.units[st.params[i].unit].params.push_back(i);
  }

  uint64_t options_hash = static_cast<uint64_t>(options.stage) * 1000003u +
                          static_cast<uint64_t>(options.bucket_bytes) * 7 +
                          options.units.size() + (options.row_shards ? 1000u : 0u) +
                          static_cast<uint64_t>(options.block_shards) * 10007u +
                          static_cast<uint64_t>(options.offload.optimizer) * 100003u +
                          static_cast<uint64_t>(options.offload.params) * 1000033u;
  if (options.comm_hook) {  // every member must reduce its segments the same way
    for (const char c : options.comm_hook->name()) {  // FNV-1a over the hook's name
      options_hash = (options_hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    }
  }

  // Segments in the order backward completes them: the wrapped units last to first, then
  // the root; inside a unit, parameters in reverse registration order.
  const int64_t cap = options.stage == 3 ? INT64_MAX : options.bucket_bytes;
  std::vector<int> unit_order;
  for (int u = st.root() - 1; u >= 0; --u) unit_order.push_back(u);
  unit_order.push_back(st.root());
  for (int u : unit_order) {
    // (decay, dtype, device, subgroup) -> segment
    std::map<std::tuple<bool, int, std::string, bool>, int> open;
    const std::vector<int>& members = st.units[u].params;
    for (auto it = members.rbegin(); it != members.rend(); ++it) {
      State::Param& p = st.params[*it];
      const bool sub = options.subgroup.has(p.name);
      const auto key = std::make_tuple(p.decay, static_cast<int>(p.tensor.dtype()),
                                       p.tensor.device().str(), sub);
      auto o = open.find(key);
      const int64_t bytes = p.tensor.nbytes();
      if (options.row_shards) {
        const ZeroOptions::RowLayout l = st.row_layout(p);
        const Shape& shown = l.shape;
        TS_CHECK(shown.size() <= 2,
                 "{}: row_shards cover 1-D and 2-D parameters; '{}' has shape {}", kName, p.name,
                 shape_str(shown));
        TS_CHECK(numel_of(shown) == p.tensor.numel() &&
                     (shown.size() < 2 || shown.back() == p.tensor.shape().back()),
                 "{}: row_layout presents '{}' of shape {} as {}; it must keep the elements "
                 "and (2-D) the last dim", kName, p.name, shape_str(p.tensor.shape()), shape_str(shown));
        TS_CHECK(l.global.size() == shown.size() && (shown.empty() || shown[0] <= l.global[0]) &&
                     (shown.size() < 2 || shown[1] == l.global[1] ||
                      (l.cols_sum && shown[1] < l.global[1])),
                 "{}: row_layout presents '{}' as {}, a block of {}: it must be some of the "
                 "rows of the whole, and all of its columns unless cols_sum is given", kName,
                 p.name, shape_str(shown), shape_str(l.global));
      }
      // (Row/block shards: a segment per parameter, so that every shard is whole rows or
      // blocks of one.)
      if (o == open.end() || st.per_param_shards() ||
          (st.segments[o->second].numel > 0 &&
           st.segments[o->second].numel * dtype_size(p.tensor.dtype()) + bytes > cap)) {
        st.segments.push_back({u, p.decay, p.tensor.dtype(), p.tensor.device()});
        st.segments.back().comm = sub ? options.subgroup.group : &comm;
        st.segments.back().scale = sub ? options.subgroup.scale : 1.0;
        st.units[u].segments.push_back(static_cast<int>(st.segments.size()) - 1);
        o = open.insert_or_assign(key, static_cast<int>(st.segments.size()) - 1).first;
      }
      State::Segment& seg = st.segments[o->second];
      p.segment = o->second;
      p.offset = seg.numel;
      seg.params.push_back(*it);
      seg.numel += p.tensor.numel();
    }
  }

  // The members agree on the parameters and the options (offload's tiers included) first;
  // then the offload budget, before the replica checks copy the parameters.
  {
    const auto [whole, sub] = split_subgroup(st.named(), options.subgroup);
    check_same_parameters(comm, kName, whole, options_hash);
    if (options.subgroup.group != nullptr) {
      check_same_parameters(*options.subgroup.group, kName, sub, options_hash);
    }
    if (options.offload.any()) offload_check(st);
    if (options.check_replicas) check_same_values(comm, kName, whole);
    if (options.subgroup.group != nullptr && options.check_replicas) {
      check_same_values(*options.subgroup.group, kName, sub);
    }
  }

  // Flat buffers: the parameters become views of them (stage 3: of a buffer released below).
  NoGradGuard no_grad;
  for (State::Segment& seg : st.segments) {
    // Row (block) shards split the parameter's rows (blocks) instead of elements; a short
    // last block stays with the rank holding it.
    const int64_t row = st.row_length(seg);
    const int n = seg.comm->size(), rank = seg.comm->rank();
    int64_t start = 0;
    for (int r = 0; r < n; ++r) {
      const int64_t count =
          std::min(block_size(st.rows_in(seg, seg.numel), n, r) * row, seg.numel - start);
      seg.counts.push_back(count);
      if (r < rank) seg.shard_start += count;
      start += count;
    }
    seg.shard_numel = seg.counts[rank];
    {
      MemoryTagScope tag(options.stage == 3 ? MemoryTag::gathered : MemoryTag::parameters);
      seg.flat_param = Tensor::empty({seg.numel}, seg.dtype, seg.device);
    }
    for (int i : seg.params) {
      State::Param& p = st.params[i];
      const Tensor view = st.param_view(seg.flat_param, p);
      view.copy_(p.tensor);
      p.tensor.set_data(view);
      p.tensor.set_grad(Tensor());
    }
    if (options.stage == 3) {
      MemoryTagScope tag(MemoryTag::parameters);
      seg.shard = st.shard_slice(seg, seg.flat_param).clone();
      seg.flat_param.storage()->release();  // one segment at a time: no full-model peak
    } else {
      seg.shard = st.shard_slice(seg, seg.flat_param);
    }
    // Offload: the host copy now (with the parameters offloaded, the device shard goes at
    // once: the device never holds more than one segment of them).
    if (options.offload.any()) offload_adopt(st, static_cast<int>(&seg - st.segments.data()));
    st.units[seg.unit].bytes += seg.numel * dtype_size(seg.dtype);
  }
  if (options.stage == 3) {
    for (State::Unit& unit : st.units) unit.gather = State::Gather::released;
  }
  st.reset_round();
  if (options.offload.any()) offload_finish_setup(st);

  if (options.stage == 0) {
    DdpOptions ddp;
    ddp.bucket_bytes = options.bucket_bytes;
    ddp.check_replicas = false;  // checked above
    ddp.average = options.average;
    ddp.comm_hook = options.comm_hook;
    ddp.subgroup = options.subgroup;
    st.ddp = std::make_unique<DistributedDataParallel>(module, comm, ddp);
    return;
  }

  // Hooks hold the state weakly: once this object is gone they do nothing.
  std::weak_ptr<State> weak = state_;
  for (int i = 0; i < static_cast<int>(st.params.size()); ++i) {
    st.params[i].tensor.register_post_accumulate_grad_hook([weak, i](const Tensor&) {
      if (std::shared_ptr<State> state = weak.lock()) state->on_gradient(i);
    });
  }
  if (options.stage == 3) {
    for (int u = 0; u < static_cast<int>(st.units.size()); ++u) {
      st.units[u].module->register_forward_pre_hook([weak, u](nn::Module&) {
        if (std::shared_ptr<State> state = weak.lock()) state->pre_forward(u);
      });
      st.units[u].module->register_forward_hook([weak, u](nn::Module&, const Tensor& out) {
        std::shared_ptr<State> state = weak.lock();
        if (!state) return Tensor();
        state->post_forward(u);
        if (u != state->root() && GradMode::enabled() && out.defined() && out.requires_grad()) {
          // The gradient of the unit's output arrives before any of its backward runs.
          out.register_hook([weak, u](const Tensor&) {
            if (std::shared_ptr<State> s = weak.lock()) s->pre_backward(u);
            return Tensor();
          });
        }
        return Tensor();
      });
    }
  }
}

ZeroDataParallel::~ZeroDataParallel() { state_->wait_all(); }

nn::Module& ZeroDataParallel::module() const { return *state_->module; }
Communicator& ZeroDataParallel::comm() const { return *state_->comm; }
const ZeroOptions& ZeroDataParallel::options() const { return state_->options; }
int ZeroDataParallel::stage() const { return state_->options.stage; }

std::vector<optim::ParamGroup> ZeroDataParallel::param_groups(double lr, double weight_decay) const {
  const State& st = *state_;
  if (st.stage() == 0) {  // the module's own parameters, grouped by the decay rule
    std::vector<optim::ParamGroup> groups(2);
    groups[0].weight_decay = weight_decay;
    groups[1].weight_decay = 0.0;
    groups[0].lr = groups[1].lr = lr;
    for (const State::Param& p : st.params) {
      optim::ParamGroup& g = groups[p.decay ? 0 : 1];
      g.params.push_back(p.tensor);
      g.names.push_back(p.name);
    }
    return groups;
  }
  std::vector<optim::ParamGroup> groups(2);
  groups[0].weight_decay = weight_decay;
  groups[1].weight_decay = 0.0;
  for (int s : st.optimizer_order()) {
    const State::Segment& seg = st.segments[s];
    optim::ParamGroup& g = groups[seg.decay ? 0 : 1];
    g.lr = lr;
    g.params.push_back(st.owner(seg));
    g.names.push_back(fmt::format("zero segment {} ({}{} elements of {})", s,
                                  st.units[seg.unit].path.empty()
                                      ? std::string("root, ")
                                      : st.units[seg.unit].path + ", ",
                                  seg.shard_numel, seg.numel));
  }
  groups[0].lr = groups[1].lr = lr;
  return groups;
}

// ---- the step ----------------------------------------------------------------------------

void ZeroDataParallel::zero_grad() {
  State& st = *state_;
  if (st.offload) offload_settle_grads(st);  // (no copy is left landing in a dropped gradient)
  for (State::Param& p : st.params) {
    p.tensor.set_grad(Tensor());
    p.adopted = false;
  }
  for (State::Segment& seg : st.segments) {
    st.owner(seg).set_grad(Tensor());
    if (st.stage() >= 2) seg.flat_grad = Tensor();
  }
}

void ZeroDataParallel::backward(const Tensor& loss) {
  loss.backward();
  finish();
}

void ZeroDataParallel::finish() {
  State& st = *state_;
  if (st.stage() == 0) {
    st.ddp->finish();
    return;
  }
  if (!st.sync) {
    if (st.stage() == 3) st.release_all();
    return;
  }
  struct ResetOnExit {
    State& st;
    ~ResetOnExit() {
      st.wait_all();
      if (st.offload) {  // (thrown past: no copy may land in a gradient dropped later)
        try {
          offload_settle_grads(st);
        } catch (...) {
        }
      }
      st.reset_round();
      if (st.stage() == 3) {
        try {
          st.release_all();
        } catch (...) {
        }
      }
    }
  } reset{st};
  while (st.next_launch < static_cast<int>(st.segments.size())) st.launch(st.next_launch++);
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) st.finalize(s);
  if (st.offload) offload_settle_grads(st);  // the gradients' copies to the host have landed
  if (st.options.comm_hook) st.options.comm_hook->end_round();
}

ZeroDataParallel::NoSync::NoSync(ZeroDataParallel& zero) : zero_(zero), previous_(zero.state_->sync) {
  if (zero.state_->ddp) {
    ddp_guard_.reset(new DistributedDataParallel::NoSync(zero.state_->ddp->no_sync()));
  }
  zero.state_->sync = false;
}

ZeroDataParallel::NoSync::~NoSync() { zero_.state_->sync = previous_; }

ZeroDataParallel::NoSync ZeroDataParallel::no_sync() { return NoSync(*this); }

double ZeroDataParallel::clip_grad_norm(double max_norm) {
  State& st = *state_;
  if (st.stage() == 0 && st.options.subgroup.group == nullptr) {
    std::vector<Tensor> ps;
    for (const State::Param& p : st.params) ps.push_back(p.tensor);
    const bool own = st.options.comm_hook && !st.options.comm_hook->full_reduction();
    if (!own) return optim::clip_grad_norm(ps, max_norm);
    // A hook that leaves each rank its own gradient (1-bit Adam after its warm-up): each
    // rank clips by its own norm, but whether a norm is inf/NaN is agreed over the group, so
    // that every rank skips (or stops on) the same steps and none waits in the optimizer's
    // reduction for a rank that skipped.
    const double norm = optim::grad_norm(ps);
    Tensor bad = Tensor::from_vector<double>({std::isfinite(norm) ? 0.0 : 1.0}, {1});
    {
      CommCause cause("zero non-finite gradient norm", CommKind::control);
      st.comm->all_reduce(bad, ReduceOp::max);
    }
    if (bad.item<double>() > 0) return std::isfinite(norm) ? std::numeric_limits<double>::infinity() : norm;
    return optim::clip_grads_to_norm(ps, norm, max_norm);
  }
  if (st.stage() == 0) {
    // Whole gradients: the group's parameters are the same everywhere; the subgroup's are
    // the same on its ranks, the subgroups' differ, so their squares are summed over the
    // whole group, each subgroup's counted group size times.
    NoGradGuard no_grad;
    std::vector<Tensor> whole, sub, all;
    for (const State::Param& p : st.params) {
      (st.options.subgroup.has(p.name) ? sub : whole).push_back(p.tensor);
      all.push_back(p.tensor);
    }
    Tensor total = Tensor::from_vector<double>({std::pow(optim::grad_norm(sub), 2)}, {1});
    {
      CommCause cause("zero clip_grad_norm", CommKind::control);
      st.comm->all_reduce(total, ReduceOp::sum);
    }
    const double norm2 = std::pow(optim::grad_norm(whole), 2) +
                         total.item<double>() / st.options.subgroup.group->size();
    return optim::clip_grads_to_norm(all, std::sqrt(norm2), max_norm);
  }
  NoGradGuard no_grad;
  std::optional<HostTierScope> host;  // offload: the gradients are on the host tier
  if (st.offload) host.emplace();
  std::vector<Tensor> shards;
  for (const State::Segment& seg : st.segments) shards.push_back(st.owner(seg));
  const double local = std::pow(optim::grad_norm(shards), 2);
  Tensor total = Tensor::from_vector<double>({local}, {1});
  {
    CommCause cause("zero clip_grad_norm", CommKind::control);
    st.comm->all_reduce(total, ReduceOp::sum);
  }
  return optim::clip_grads_to_norm(shards, std::sqrt(total.item<double>()), max_norm);
}

double ZeroDataParallel::local_grad_norm_squared(
    const std::function<double(const std::string&)>& weight) const {
  State& st = *state_;
  if (st.offload) offload_settle_grads(st);
  NoGradGuard no_grad;
  // One op per tensor (what sum(cast(g, f64)^2) gives, bitwise on the CPU).
  auto sum_sq = [](const Tensor& g) { return sum_squares({g}).item<double>(); };
  double total = 0.0;
  if (st.stage() == 0) {
    for (const State::Param& p : st.params) {
      const Tensor g = p.tensor.grad();
      const double w = weight(p.name);
      if (g.defined() && g.numel() > 0 && w != 0.0) total += w * sum_sq(g);
    }
    return total;
  }
  std::optional<HostTierScope> host;
  if (st.offload) host.emplace();
  for (const State::Segment& seg : st.segments) {
    const Tensor g = st.owner(seg).grad();
    if (!g.defined() || seg.shard_numel == 0) continue;
    for (int i : seg.params) {  // the part of each parameter inside this rank's block
      const State::Param& p = st.params[i];
      const int64_t lo = std::max(p.offset, seg.shard_start);
      const int64_t hi = std::min(p.offset + p.tensor.numel(), seg.shard_start + seg.shard_numel);
      const double w = weight(p.name);
      if (lo < hi && w != 0.0) total += w * sum_sq(g.narrow(0, lo - seg.shard_start, hi - lo));
    }
  }
  return total;
}

void ZeroDataParallel::scale_grads(double coef) {
  State& st = *state_;
  if (st.offload) offload_settle_grads(st);
  NoGradGuard no_grad;
  std::vector<Tensor> owned;
  std::optional<HostTierScope> host;
  if (st.offload) host.emplace();
  if (st.stage() == 0) {
    for (const State::Param& p : st.params) owned.push_back(p.tensor);
  } else {
    for (const State::Segment& seg : st.segments) owned.push_back(st.owner(seg));
  }
  std::vector<Tensor> grads;  // one scale_ (f32 for f32 and 16-bit gradients, as clipping)
  for (const Tensor& t : owned) {
    const Tensor g = t.grad();
    if (g.defined() && g.numel() > 0) grads.push_back(g);
  }
  if (!grads.empty()) scale_(grads, coef);
}

void attach_row_shards(ZeroDataParallel::State& st, optim::Optimizer& optimizer) {
  if (!st.per_param_shards()) return;
  std::map<const TensorImpl*, optim::RowShard> shards;
  if (st.stage() == 0) {
    // The optimizer steps the parameters themselves (whole on every rank): only those
    // presented in another shape are row shards, of all their rows, with nothing to sum.
    for (const ZeroDataParallel::State::Param& p : st.params) {
      if (!st.options.row_layout) continue;
      const ZeroOptions::RowLayout l = st.row_layout(p);
      if (st.options.block_shards > 0) {  // (blocks of the whole tensor: global and run)
        const int64_t block = st.options.block_shards;
        shards[p.tensor.impl()] = {l.global, 0, (p.tensor.numel() + block - 1) / block,
                                   [](const Tensor&) {}, block, p.name, nullptr, l.run,
                                   l.run_stride, l.run_first, l.runs_max};
        continue;
      }
      if (l.shape == p.tensor.shape() && l.global == l.shape && !l.rows_sum && !l.cols_sum) continue;
      shards[p.tensor.impl()] = {l.global, 0, l.shape.size() == 2 ? l.shape[0] : p.tensor.numel(),
                                 l.rows_sum ? l.rows_sum : [](const Tensor&) {}, 0, p.name,
                                 l.cols_sum};
    }
    if (!shards.empty()) optimizer.set_row_shards(std::move(shards));
    return;
  }
  // Where each shard sits, and the sum over the dp group the optimizer reduces with.
  Communicator* comm = st.comm;
  for (const ZeroDataParallel::State::Segment& seg : st.segments) {
    const int64_t row = st.row_length(seg);
    const ZeroDataParallel::State::Param& p = st.params[seg.params.front()];
    const ZeroOptions::RowLayout l = st.row_layout(p);
    shards[seg.shard.impl()] = {l.global, seg.shard_start / row,
                                st.rows_in(seg, seg.shard_numel),
                                [comm, rows_sum = l.rows_sum](const Tensor& t) {
                                  {
                                    CommCause cause("zero row-shard statistics");
                                    comm->all_reduce(t, ReduceOp::sum);
                                  }
                                  if (rows_sum) rows_sum(t);
                                },
                                st.options.block_shards, p.name, l.cols_sum, l.run,
                                l.run_stride, l.run_first,
                                [comm, runs_max = l.runs_max](const Tensor& t) {
                                  {
                                    CommCause cause("zero block-shard scales");
                                    comm->all_reduce(t, ReduceOp::max);
                                  }
                                  if (runs_max) runs_max(t);
                                }};
  }
  optimizer.set_row_shards(std::move(shards));
}

void ZeroDataParallel::step(optim::Optimizer& optimizer) {
  State& st = *state_;
  check_elementwise(optimizer, st.stage(), "step", st.options);
  attach_row_shards(st, optimizer);
  // The parameters' new values arrive by all-gather, file or host copy (no version moves).
  clear_cast_cache();
  if (st.offload) {
    offload_step(st, optimizer);  // the update on the host, the shards copied back
  } else {
    MemoryTagScope tag(MemoryTag::optimizer_state);
    optimizer.step();
  }
  if (st.stage() == 1 || st.stage() == 2) {
    NoGradGuard no_grad;
    CommCause cause("zero all_gather parameters", CommKind::parameters);
    std::vector<std::pair<WorkHandle, Tensor>> works;
    for (State::Segment& seg : st.segments) {
      Tensor send = seg.shard.clone();  // the output holds the shard itself: do not alias
      works.emplace_back(seg.comm->all_gather_async(seg.flat_param, send, seg.counts), send);
    }
    for (auto& [work, send] : works) work->wait();
  }
}

void ZeroDataParallel::complete_step() {
  clear_cast_cache();
  if (state_->offload) offload_complete(*state_);
}

// ---- memory ------------------------------------------------------------------------------

ZeroMemory ZeroDataParallel::memory_report() const {
  State& st = *state_;
  const MemoryTracker& t = MemoryScope::current() ? *MemoryScope::current() : process_memory();
  ZeroMemory m;
  m.stage = st.stage();
  m.ranks = st.comm->size();
  m.numel = st.numel;
  if (st.options.subgroup.group != nullptr) {
    m.sub_ranks = st.options.subgroup.group->size();
    for (const State::Param& p : st.params) {
      if (st.options.subgroup.has(p.name)) m.sub_numel += p.tensor.numel();
    }
  }
  m.parameters = t.current(MemoryTag::parameters);
  m.gradients = t.current(MemoryTag::gradients);
  m.optimizer_state = t.current(MemoryTag::optimizer_state);
  m.gradients_peak = t.peak(MemoryTag::gradients);
  m.gathered_peak = t.peak(MemoryTag::gathered);
  if (st.stage() == 3) {
    for (int u = 0; u < st.root(); ++u) m.largest_unit = std::max(m.largest_unit, st.units[u].bytes);
    m.root_unit = st.units[st.root()].bytes;
  }
  return m;
}

double ZeroMemory::formula() const {
  const double k = state_per_param;
  const auto part = [&](double psi, double n) {
    switch (stage) {
      case 0: return (8 + k) * psi;
      case 1: return 8 * psi + k * psi / n;
      case 2: return 4 * psi + (4 + k) * psi / n;
      default: return (8 + k) * psi / n;
    }
  };
  return part(static_cast<double>(numel - sub_numel), ranks) +
         part(static_cast<double>(sub_numel), sub_ranks);
}

std::string ZeroMemory::str() const {
  auto mib = [](double b) { return fmt::format("{:.2f} MiB", b / (1 << 20)); };
  std::string s = fmt::format(
      "memory per rank (ZeRO stage {}, {} ranks, Ψ = {} parameters{}): parameters {}, gradients "
      "{} (peak {}), optimizer state {}; sum {} vs formula {} ({:.3f}x; optimizer state {:.3g} "
      "bytes per parameter)",
      stage, ranks, numel,
      sub_numel > 0 ? fmt::format(" here, {} of them over {} ranks", sub_numel, sub_ranks) : "",
      mib(parameters), mib(gradients), mib(gradients_peak),
      mib(optimizer_state), mib(measured()), mib(formula()),
      measured() / std::max(formula(), 1.0), state_per_param);
  if (stage == 3) {
    s += fmt::format("; gathered peak {} (root unit {}, largest unit {})", mib(gathered_peak),
                     mib(root_unit), mib(largest_unit));
  }
  return s;
}

}  // namespace tessera::parallel
