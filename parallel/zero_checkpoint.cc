// ZeroDataParallel's checkpoints: conversion between this rank's shards and the
// single-device layout of the model's and the optimizer's state dicts.
#include "parallel/zero.h"

#include <map>
#include <optional>
#include <set>

#include "parallel/zero_state.h"

namespace tessera::parallel {
namespace {

optim::Optimizer::RowShardState row_shard_state(const optim::Optimizer& optimizer,
                                                const std::string& name,
                                                const ZeroOptions::RowLayout& layout) {
  return optimizer.row_shard_state(name, layout.global, layout.run, layout.run_first);
}

}  // namespace

// ---- checkpoints -------------------------------------------------------------------------

nn::StateDict ZeroDataParallel::model_state_dict() {
  State& st = *state_;
  NoGradGuard no_grad;
  // Offload: the copies on the host tier (the dict is the whole model, which the device
  // budget may not hold).
  std::optional<HostTierScope> host;
  if (st.offload) host.emplace();
  nn::StateDict out;
  const nn::StateDict handles = st.module->state_dict();
  auto copy = [&](const Tensor& v) { return st.offload && !v.device().is_cpu() ? v.to(kCPU) : v.clone(); };
  if (st.stage() != 3) {
    for (const auto& [k, v] : handles) out[k] = copy(v);
    return out;
  }
  // Stage 3: a unit at a time (gathered, copied, released), so the device holds one unit
  // beside the copies; what no unit holds (buffers) is copied as it is.
  // (By storage: a parameter is a view of its segment's flat buffer, whatever handle the
  // state dict gives.)
  std::map<const StorageImpl*, int> unit_of;
  for (const State::Segment& seg : st.segments) unit_of[seg.flat_param.storage().get()] = seg.unit;
  try {
    for (int u = 0; u < static_cast<int>(st.units.size()); ++u) {
      st.ensure_gathered(u);
      for (const auto& [k, v] : handles) {
        auto it = unit_of.find(v.storage().get());
        if (it != unit_of.end() && it->second == u) out[k] = copy(v);
      }
      st.release(u);
    }
  } catch (...) {
    st.release_all();
    throw;
  }
  for (const auto& [k, v] : handles) {
    if (!unit_of.count(v.storage().get())) out[k] = copy(v);
  }
  return out;
}

nn::StateDict ZeroDataParallel::gradient_dict() {
  State& st = *state_;
  if (st.offload) offload_settle_grads(st);
  NoGradGuard no_grad;
  nn::StateDict out;
  if (st.stage() == 0) {
    for (const State::Param& p : st.params) {
      const Tensor g = p.tensor.grad();
      out[p.name] = g.defined() ? g.clone() : zeros(p.tensor.shape(), p.tensor.dtype(), p.tensor.device());
    }
    return out;
  }
  CommCause cause("zero gather gradients");
  for (const State::Segment& seg : st.segments) {
    const Tensor g = st.owner(seg).grad();  // offload: on the host
    const Tensor mine = g.defined() ? g.contiguous().to(seg.device)
                                    : zeros({seg.shard_numel}, seg.dtype, seg.device);
    const Tensor full = Tensor::empty({seg.numel}, seg.dtype, seg.device);
    seg.comm->all_gather(full, mine, seg.counts);
    for (int i : seg.params) out[st.params[i].name] = st.param_view(full, st.params[i]).clone();
  }
  return out;
}

void ZeroDataParallel::load_model_state_dict(const nn::StateDict& dict) {
  State& st = *state_;
  NoGradGuard no_grad;
  if (st.stage() != 3) {
    st.module->load_state_dict(dict);
    if (st.offload) {  // the optimizer's host copies take the new values too
      for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) {
        offload_set_shard(st, s, st.segments[s].shard);
      }
    }
    return;
  }
  for (int u = 0; u < static_cast<int>(st.units.size()); ++u) st.ensure_gathered(u);
  try {
    st.module->load_state_dict(dict);
  } catch (...) {
    st.release_all();
    throw;
  }
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) {
    State::Segment& seg = st.segments[s];
    if (st.offload) offload_set_shard(st, s, st.shard_slice(seg, seg.flat_param));
    else seg.shard.copy_(st.shard_slice(seg, seg.flat_param));
  }
  st.release_all();
}


optim::Optimizer::StateDict ZeroDataParallel::optimizer_state_dict(const optim::Optimizer& optimizer) {
  State& st = *state_;
  check_elementwise(optimizer, st.stage(), "optimizer_state_dict", st.options);
  // Offload: the copies and gathers on the host tier (a device budget holds no model state).
  std::optional<HostTierScope> host;
  if (st.offload) host.emplace();
  optim::Optimizer::StateDict shard_dict;
  if (st.offload) {  // the file tier's pages in for the copy, and out again
    offload_page_all(st, &optimizer, /*in=*/true);
    shard_dict = optimizer.state_dict();
    offload_page_all(st, &optimizer, /*in=*/false);
  } else {
    shard_dict = optimizer.state_dict();
  }
  if (st.stage() == 0) return shard_dict;
  NoGradGuard no_grad;
  const std::vector<int> order = st.canonical_order();
  std::vector<int> index_of(st.params.size());
  for (int k = 0; k < static_cast<int>(order.size()); ++k) index_of[order[k]] = k;

  optim::Optimizer::StateDict out;
  for (const auto& [k, v] : shard_dict) {
    if (k.rfind("hparam.", 0) == 0 || k.ends_with(".lr") || k.ends_with(".weight_decay")) {
      out[k] = v;
    }
  }
  std::vector<int64_t> group_params[2];
  for (int k = 0; k < static_cast<int>(order.size()); ++k) {
    group_params[st.params[order[k]].decay ? 0 : 1].push_back(k);
  }
  for (int g = 0; g < 2; ++g) {
    out[fmt::format("group.{}.params", g)] = Tensor::from_vector<int64_t>(
        group_params[g], {static_cast<int64_t>(group_params[g].size())});
  }
  const std::vector<int> seg_order = st.optimizer_order();
  CommCause cause("zero gather optimizer state");
  for (int j = 0; j < static_cast<int>(seg_order.size()); ++j) {
    const State::Segment& seg = st.segments[seg_order[j]];
    const std::string prefix = fmt::format("state.{}.", j);
    for (const auto& [k, v] : shard_dict) {
      if (k.rfind(prefix, 0) != 0) continue;
      const std::string name = k.substr(prefix.size());
      if (name == "step") {
        for (int i : seg.params) out[fmt::format("state.{}.step", index_of[i])] = v.clone();
        continue;
      }
      // Row shards (one parameter per segment): per-row state gathers by rows, state the
      // same on every shard is the whole tensor's.
      const auto layout =
          st.per_param_shards()
              ? row_shard_state(optimizer, name, st.row_layout(st.params[seg.params.front()]))
              : optim::Optimizer::RowShardState::elements;
      if (layout == optim::Optimizer::RowShardState::whole) {
        out[fmt::format("state.{}.{}", index_of[seg.params.front()], name)] = v.clone();
        continue;
      }
      if (layout == optim::Optimizer::RowShardState::rows) {
        std::vector<int64_t> counts;
        for (int64_t c : seg.counts) counts.push_back(st.rows_in(seg, c));
        TS_CHECK(v.dim() == 1 && v.numel() == st.rows_in(seg, seg.shard_numel),
                 "{}: optimizer state '{}' has shape {}, expected [{}] (the shard's rows)", kName,
                 k, shape_str(v.shape()), st.rows_in(seg, seg.shard_numel));
        const Tensor full = Tensor::empty({st.rows_in(seg, seg.numel)}, v.dtype(), v.device());
        seg.comm->all_gather(full, v.contiguous(), counts);
        out[fmt::format("state.{}.{}", index_of[seg.params.front()], name)] = full;
        continue;
      }
      TS_CHECK(v.dim() == 1 && v.numel() == seg.shard_numel,
               "{}: optimizer state '{}' has shape {}, expected [{}] (the shard)", kName, k,
               shape_str(v.shape()), seg.shard_numel);
      const Tensor full = Tensor::empty({seg.numel}, v.dtype(), v.device());
      seg.comm->all_gather(full, v.contiguous(), seg.counts);
      for (int i : seg.params) {
        const State::Param& p = st.params[i];
        out[fmt::format("state.{}.{}", index_of[i], name)] = st.param_view(full, p).clone();
      }
    }
  }
  return out;
}

void ZeroDataParallel::load_optimizer_state_dict(optim::Optimizer& optimizer,
                                                 const optim::Optimizer::StateDict& dict) {
  State& st = *state_;
  check_elementwise(optimizer, st.stage(), "load_optimizer_state_dict", st.options);
  attach_row_shards(st, optimizer);
  std::optional<HostTierScope> host;  // offload: the new state on the host tier
  if (st.offload) host.emplace();  // the optimizer checks the shards' state shapes
  if (st.stage() == 0) {
    optimizer.load_state_dict(dict);
    return;
  }
  NoGradGuard no_grad;
  const std::vector<int> order = st.canonical_order();
  std::vector<int> index_of(st.params.size());
  for (int k = 0; k < static_cast<int>(order.size()); ++k) index_of[order[k]] = k;

  optim::Optimizer::StateDict out;
  // (The file tier: the state pages in for state_dict(), which copies them; the loaded state
  // replaces them and pages out below.)
  if (st.offload) offload_page_all(st, &optimizer, /*in=*/true);
  // Keys the optimizer's own dict has about its groups (segment indices) stay its own.
  for (const auto& [k, v] : optimizer.state_dict()) {
    if (k.rfind("group.", 0) == 0 && k.ends_with(".params")) out[k] = v;
  }
  for (const auto& [k, v] : dict) {
    if (k.rfind("hparam.", 0) == 0 || (k.rfind("group.", 0) == 0 && !k.ends_with(".params"))) {
      out[k] = v;
    }
  }
  for (int g = 0; g < 2; ++g) {
    const std::string key = fmt::format("group.{}.params", g);
    auto it = dict.find(key);
    TS_CHECK(it != dict.end(), "{}: optimizer state dict has no '{}'", kName, key);
    int64_t expected = 0;
    for (const State::Param& p : st.params) expected += p.decay == (g == 0);
    TS_CHECK(it->second.numel() == expected,
             "{}: optimizer state dict's group {} holds {} parameters, this model {}", kName, g,
             it->second.numel(), expected);
  }
  const std::vector<int> seg_order = st.optimizer_order();
  for (int j = 0; j < static_cast<int>(seg_order.size()); ++j) {
    const State::Segment& seg = st.segments[seg_order[j]];
    // Every member's state names and step must agree (a segment steps as one).
    std::set<std::string> names;
    int with_state = 0;
    int64_t step = -1;
    for (int i : seg.params) {
      const std::string prefix = fmt::format("state.{}.", index_of[i]);
      auto it = dict.find(prefix + "step");
      if (it == dict.end()) continue;
      ++with_state;
      const int64_t s = it->second.item<int64_t>();
      TS_CHECK(step < 0 || s == step,
               "{}: parameters '{}' and its segment's others have different step counts ({} "
               "and {}); a segment steps as one",
               kName, st.params[i].name, s, step);
      step = s;
      for (auto k = dict.lower_bound(prefix); k != dict.end() && k->first.rfind(prefix, 0) == 0; ++k) {
        if (k->first != prefix + "step") names.insert(k->first.substr(prefix.size()));
      }
    }
    if (with_state == 0) continue;
    TS_CHECK(with_state == static_cast<int>(seg.params.size()),
             "{}: only {} of the {} parameters of segment {} have optimizer state", kName,
             with_state, seg.params.size(), seg_order[j]);
    out[fmt::format("state.{}.step", j)] = Tensor::from_vector<int64_t>({step}, {});
    for (const std::string& name : names) {
      const auto layout =
          st.per_param_shards()
              ? row_shard_state(optimizer, name, st.row_layout(st.params[seg.params.front()]))
              : optim::Optimizer::RowShardState::elements;
      if (layout != optim::Optimizer::RowShardState::elements) {
        // One parameter: its per-row state's block of rows, or the whole state.
        const std::string key = fmt::format("state.{}.{}", index_of[seg.params.front()], name);
        auto it = dict.find(key);
        TS_CHECK(it != dict.end(), "{}: optimizer state dict has no '{}'", kName, key);
        const int64_t row = st.row_length(seg);
        out[fmt::format("state.{}.{}", j, name)] =
            layout == optim::Optimizer::RowShardState::whole
                ? it->second.clone()
                : it->second.narrow(0, seg.shard_start / row, st.rows_in(seg, seg.shard_numel))
                      .clone();
        continue;
      }
      Tensor full;
      for (int i : seg.params) {
        const State::Param& p = st.params[i];
        const std::string key = fmt::format("state.{}.{}", index_of[i], name);
        auto it = dict.find(key);
        TS_CHECK(it != dict.end(), "{}: optimizer state dict has no '{}'", kName, key);
        TS_CHECK(it->second.shape() == p.tensor.shape(),
                 "{}: optimizer state '{}' has shape {}, parameter '{}' is {}", kName, key,
                 shape_str(it->second.shape()), p.name, shape_str(p.tensor.shape()));
        if (!full.defined()) full = Tensor::empty({seg.numel}, it->second.dtype(), seg.device);
        st.param_view(full, p).copy_(it->second);
      }
      out[fmt::format("state.{}.{}", j, name)] = st.shard_slice(seg, full).clone();
    }
  }
  optimizer.load_state_dict(out);
  if (st.offload) offload_page_all(st, &optimizer, /*in=*/false);  // to the file tier
}

}  // namespace tessera::parallel
