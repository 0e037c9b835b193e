// Gpt3d's checkpoints: the single device's state dicts (gathered over tp, broadcast over
// pp) and sharded blocks, for the parameters and every optimizer's state fields.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "models/gpt/parallel3d_impl.h"
#include "parallel/sharded_tensor.h"
#include "tensor/error.h"

namespace tessera::gpt {

Tensor gather_full(Gpt3d::Impl& s, const std::string& name, const Tensor& local, const Shape& shape,
                   DType dtype) {
  const int owner = s.owner.at(name);
  Tensor full = zeros(shape, dtype);
  if (s.pp().rank() == owner) {
    const parallel::ShardedTensor& p = s.tp->param(name);
    full = parallel::ShardedTensor(local.contiguous().view(p.local().shape()), s.tp_mesh,
                                   p.placements(), p.shape())
               .full_tensor()
               .contiguous()
               .view(shape)
               .clone();
  }
  s.pp().broadcast(full, owner);
  // An expert's parameter (or state): this rank's experts, whole over ep.
  if (const parallel::ExpertGroups* experts = s.moe->groups()) full = experts->whole(name, full);
  return full;
}

namespace {

// One state field of a parameter: its name, dtype and shape on the parameter's owner.
struct Field {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
};

// The state fields of parameter `name` (the owner's `fields`) on every pp rank: optimizers
// keep different fields per parameter (8-bit AdamW f32 state below its size threshold,
// Adafactor whole second moments for vectors), so the ranks that do not hold it learn them
// from the owner. Two broadcasts over pp: the length, then the encoding.
std::vector<Field> fields_from_owner(Gpt3d::Impl& s, const std::string& name,
                                     const std::vector<Field>& fields) {
  const int owner = s.owner.at(name);
  std::vector<int64_t> code;
  if (s.pp().rank() == owner) {
    code.push_back(static_cast<int64_t>(fields.size()));
    for (const Field& f : fields) {
      code.push_back(static_cast<int64_t>(f.dtype));
      code.push_back(static_cast<int64_t>(f.shape.size()));
      code.insert(code.end(), f.shape.begin(), f.shape.end());
      code.push_back(static_cast<int64_t>(f.name.size()));
      for (char c : f.name) code.push_back(static_cast<unsigned char>(c));
    }
  }
  Tensor length = Tensor::from_vector<int64_t>({static_cast<int64_t>(code.size())}, {1});
  s.pp().broadcast(length, owner);
  const int64_t n = length.to_vector<int64_t>()[0];
  Tensor encoded = s.pp().rank() == owner ? Tensor::from_vector<int64_t>(code, {n})
                                          : zeros({n}, DType::i64);
  s.pp().broadcast(encoded, owner);
  code = encoded.to_vector<int64_t>();
  std::vector<Field> out(static_cast<size_t>(code.at(0)));
  size_t at = 1;
  for (Field& f : out) {
    f.dtype = static_cast<DType>(code.at(at++));
    f.shape.resize(static_cast<size_t>(code.at(at++)));
    for (int64_t& d : f.shape) d = code.at(at++);
    f.name.resize(static_cast<size_t>(code.at(at++)));
    for (char& c : f.name) c = static_cast<char>(code.at(at++));
  }
  return out;
}

// Whether optimizer state `field` has the parameter's elements (cut like the parameter by
// tp), rather than one value per row or block, or the same tensor on every shard. (Where
// the parameter is not held, only whether it is per element matters: tp_runs is 0 there.)
optim::Optimizer::RowShardState state_kind(const Gpt3d::Impl& s, const std::string& name,
                                           const std::string& field) {
  const TpRuns runs = tp_runs(s, name);
  return s.opt->row_shard_state(field, s.whole.at(name), runs.run, runs.first);
}
bool per_element(const Gpt3d::Impl& s, const std::string& name, const std::string& field) {
  return state_kind(s, name, field) == optim::Optimizer::RowShardState::elements;
}

// How optimizer state `field` of parameter `name` (held here) lies over tp: the tensor its
// tp blocks form (shape and placements) and this rank's block. `local` is this rank's state
// tensor. Per element: as the parameter. Otherwise with tp 1 (8-bit AdamW's scales per
// block; Adafactor's statistics) the tensor is whole. On tp shards: 8-bit AdamW's scales
// by the shard's runs of whole blocks, or whole where the runs cut blocks (below);
// Adafactor's row statistics as the parameter without its last dim, its column statistics
// as its last dim alone, a split of the dim that is dropped leaving them whole on tp.
struct StateBlock {
  Shape global;
  parallel::Placements placements;
  parallel::LocalBlock block;
};
// An expert parameter's block (with ep, or per-element state of it) as the single device
// holds it: dim 0 runs over the E experts, this rank's from its first.
void whole_experts(const Gpt3d::Impl& s, const std::string& name, Shape& global,
                   std::vector<int64_t>& starts) {
  const parallel::ExpertGroups* experts = s.moe->groups();
  if (experts == nullptr || !experts->holds(name)) return;
  global = experts->whole_shape(name, global);
  starts.at(0) += experts->first();
}

StateBlock state_block(const Gpt3d::Impl& s, const std::string& name, const std::string& field,
                       const Tensor& local) {
  const parallel::ShardedTensor& p = s.tp->param(name);
  StateBlock b;
  if (per_element(s, name, field)) {
    b.global = p.shape();
    b.placements = p.placements();
  } else if (s.o.tp == 1) {
    b.global = local.shape();
    b.placements = {parallel::Replicate()};
  } else if (s.opt->shard_block() > 0) {
    // Per block of the whole (8-bit AdamW's scales): a shard's runs of L elements (one per
    // index of the dims before the split one, R of them) hold L / block blocks each, so the
    // scales lie as [R, tp x L / block] split on dim 1; whole on tp as the parameter is, or
    // where the runs cut blocks (every holder keeps all the scales).
    const parallel::Placement& on_tp = p.placements()[0];
    const int64_t block = s.opt->shard_block();
    if (on_tp.is_shard() && state_kind(s, name, field) == optim::Optimizer::RowShardState::rows) {
      int64_t runs = 1;
      for (int64_t d = 0; d < on_tp.dim; ++d) runs *= p.shape()[static_cast<size_t>(d)];
      b.global = {runs, numel_of(p.shape()) / runs / block};
      b.placements = {parallel::Shard(1)};
    } else {
      b.global = {(numel_of(p.shape()) + block - 1) / block};
      b.placements = {parallel::Replicate()};
    }
  } else {
    const parallel::Placement& on_tp = p.placements()[0];
    const int64_t last = static_cast<int64_t>(p.shape().size()) - 1;
    const bool rows = state_kind(s, name, field) == optim::Optimizer::RowShardState::rows;
    if (rows) {
      b.global = Shape(p.shape().begin(), p.shape().end() - 1);
      b.placements = {on_tp.is_shard(last) ? parallel::Replicate() : on_tp};
    } else {
      b.global = {p.shape().back()};
      b.placements = {on_tp.is_shard(last) ? parallel::Shard(0) : parallel::Replicate()};
    }
  }
  b.block = parallel::local_block(b.global, *s.tp_mesh, b.placements);
  return b;
}

}  // namespace

Tensor region_of(const Tensor& whole, const std::string& key, const Shape& global,
                 const std::vector<int64_t>& starts, const Shape& shape) {
  TS_CHECK(whole.numel() == numel_of(global),
           "Gpt3d: the checkpoint's '{}' has shape {}, the model's {}", key,
           shape_str(whole.shape()), shape_str(global));
  Tensor t = whole.contiguous().view(global);
  for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(static_cast<int64_t>(d), starts[d], shape[d]);
  return t.contiguous().clone();
}

std::map<std::string, Tensor> Gpt3d::full_parameters() {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  const nn::StateDict holder = s.zero->model_state_dict();  // our tp shards, whole over dp
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : s.model.named_parameters()) {
    auto it = holder.find(flat_name(name));
    out[name] = gather_full(s, name, it != holder.end() ? it->second : Tensor(), t.shape(), t.dtype());
  }
  for (const auto& [name, t] : s.model.named_buffers()) out[name] = t.clone();
  return out;
}

std::pair<nn::StateDict, optim::Optimizer::StateDict> Gpt3d::state_dicts() {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  const std::map<std::string, Tensor> params = full_parameters();
  nn::StateDict weights(params.begin(), params.end());
  // ZeRO gives the state of an optimizer over this rank's shards, indexed in holder_order.
  const optim::Optimizer::StateDict mine = s.zero->optimizer_state_dict(*s.opt);
  optim::Optimizer::StateDict out;
  for (const auto& [key, v] : mine) {
    if (key.starts_with("hparam.") || key.ends_with(".lr") || key.ends_with(".weight_decay")) {
      out[key] = v;
    }
  }
  std::map<std::string, int64_t> holder_index;
  for (size_t i = 0; i < s.holder_order.size(); ++i) holder_index[s.holder_order[i]] = static_cast<int64_t>(i);
  std::vector<int64_t> group[2];
  const nn::NamedTensors named = s.model.named_parameters();
  const std::map<std::string, Tensor> shapes(named.begin(), named.end());
  for (size_t i = 0; i < s.model_order.size(); ++i) {
    group[shapes.at(s.model_order[i]).dim() >= 2 ? 0 : 1].push_back(static_cast<int64_t>(i));
  }
  for (int g = 0; g < 2; ++g) {
    out[fmt::format("group.{}.params", g)] =
        Tensor::from_vector<int64_t>(group[g], {static_cast<int64_t>(group[g].size())});
  }
  const bool stepped = mine.count("state.0.step") == 1;  // false before the first step
  for (size_t i = 0; stepped && i < s.model_order.size(); ++i) {
    const std::string& name = s.model_order[i];
    const Tensor& param = shapes.at(name);
    const bool here = s.pp().rank() == s.owner.at(name);
    const std::string from = here ? fmt::format("state.{}.", holder_index.at(name)) : "";
    Tensor step = here ? mine.at(from + "step").clone() : zeros({}, DType::i64);
    s.pp().broadcast(step, s.owner.at(name));
    out[fmt::format("state.{}.step", i)] = step;
    std::vector<Field> held;
    if (here) {
      for (const auto& [key, v] : mine) {
        if (key.starts_with(from) && key != from + "step") {
          held.push_back({key.substr(from.size()), v.dtype(), v.shape()});
        }
      }
    }
    for (const Field& f : fields_from_owner(s, name, held)) {
      const Tensor local = here ? mine.at(from + f.name) : Tensor();
      if (per_element(s, name, f.name)) {
        out[fmt::format("state.{}.{}", i, f.name)] =
            gather_full(s, name, local, param.shape(), f.dtype);
        continue;
      }
      if (s.o.tp == 1) {  // (per block or row, or whole: the owner's tensor is the single device's)
        Tensor t = here ? local.contiguous().clone() : zeros(f.shape, f.dtype);
        s.pp().broadcast(t, s.owner.at(name));
        out[fmt::format("state.{}.{}", i, f.name)] = t;
        continue;
      }
      // On tp shards: 8-bit AdamW's scales [blocks]; Adafactor's rows' statistics [M], its
      // columns' [N] of the single device's M x N parameter; gathered over tp on the owner,
      // then broadcast over pp.
      const bool rows = state_kind(s, name, f.name) == optim::Optimizer::RowShardState::rows;
      const int64_t block = s.opt->shard_block();
      Tensor t = zeros({block > 0 ? (param.numel() + block - 1) / block
                        : rows    ? param.size(0)
                                  : param.size(-1)},
                       f.dtype);
      if (here) {
        const StateBlock b = state_block(s, name, f.name, local);
        t = parallel::ShardedTensor(local.contiguous().view(b.block.shape), s.tp_mesh,
                                    b.placements, b.global)
                .full_tensor()
                .contiguous()
                .view(t.shape())
                .clone();
      }
      s.pp().broadcast(t, s.owner.at(name));
      out[fmt::format("state.{}.{}", i, f.name)] = t;
    }
  }
  return {std::move(weights), std::move(out)};
}

void Gpt3d::load_state_dicts(const nn::StateDict& weights, const optim::Optimizer::StateDict& dict) {
  Impl& s = *impl_;
  // The single-device dicts as a block source: a region is cut from the whole tensor.
  std::map<std::string, int64_t> model_index;
  for (size_t i = 0; i < s.model_order.size(); ++i) model_index[s.model_order[i]] = static_cast<int64_t>(i);
  const auto lookup = [&](const std::string& key) -> const Tensor& {
    if (key.starts_with("model/")) {
      auto it = weights.find(key.substr(6));
      TS_CHECK(it != weights.end(), "Gpt3d: the checkpoint has no parameter or buffer '{}'{}",
               key.substr(6),
               key.ends_with("selection_bias")
                   ? " (the experts' selection bias: was it saved with --moe_bias_rate 0?)"
                   : "");
      return it->second;
    }
    // "optim/<param>/<field>" is state.<i>.<field>; "optim/<key>" is <key>.
    const std::string rest = key.substr(6);
    const size_t slash = rest.find('/');
    const std::string dict_key =
        slash == std::string::npos
            ? rest
            : fmt::format("state.{}.{}", model_index.at(rest.substr(0, slash)), rest.substr(slash + 1));
    auto it = dict.find(dict_key);
    TS_CHECK(it != dict.end(), "Gpt3d: the optimizer state has no '{}'", dict_key);
    return it->second;
  };
  BlockSource source;
  source.whole = [&](const std::string& key) { return lookup(key).clone(); };
  source.region = [&](const std::string& key, const Shape& global,
                      const std::vector<int64_t>& starts, const Shape& shape) {
    return region_of(lookup(key), key, global, starts, shape);
  };
  source.keys = [&](const std::string& prefix) {
    std::vector<std::string> out;
    for (const auto& [key, v] : dict) {
      std::string k;
      if (key.starts_with("hparam.") || (key.starts_with("group.") && !key.ends_with(".params"))) {
        k = "optim/" + key;
      } else if (key.starts_with("state.")) {
        const size_t dot = key.find('.', 6);
        const int64_t i = std::stoll(key.substr(6, dot - 6));
        k = fmt::format("optim/{}/{}", s.model_order.at(static_cast<size_t>(i)), key.substr(dot + 1));
      }
      if (!k.empty() && k.starts_with(prefix)) out.push_back(k);
    }
    return out;
  };
  read_blocks(source);
}

void Gpt3d::write_blocks(const AddBlock& add) {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  const nn::StateDict holder = s.zero->model_state_dict();                   // over dp
  const optim::Optimizer::StateDict mine = s.zero->optimizer_state_dict(*s.opt);  // over dp
  if (s.world->rank() == 0) {
    for (const auto& [key, v] : mine) {
      if (key.starts_with("hparam.") || (key.starts_with("group.") && !key.ends_with(".params"))) {
        add("optim/" + key, v, v.shape(), std::vector<int64_t>(static_cast<size_t>(v.dim()), 0));
      }
    }
    for (const auto& [name, t] : s.model.named_buffers()) {  // whole, the same everywhere
      add("model/" + name, t, t.shape(), std::vector<int64_t>(static_cast<size_t>(t.dim()), 0));
    }
  }
  // The dp replicas hold the same shards: dp rank 0 writes them, and each expert's the first
  // of the ranks holding it.
  const parallel::ExpertGroups* experts = s.moe->groups();
  const bool dp_lead = s.dp().rank() == 0;
  const bool tp_lead = s.tp_mesh->group(0).rank() == 0;
  for (size_t k = 0; k < s.holder_order.size(); ++k) {
    const std::string& name = s.holder_order[k];
    const bool expert = experts != nullptr && experts->holds(name);
    if (!(expert ? experts->edp().rank() == 0 : dp_lead)) continue;
    if (s.owner.at(name) != s.pp().rank()) continue;  // the tied embedding once
    const parallel::ShardedTensor& p = s.tp->param(name);
    if (!p.placements()[0].is_shard() && !tp_lead) continue;  // whole on tp: written once
    const parallel::LocalBlock b = parallel::local_block(p.shape(), *s.tp_mesh, p.placements());
    Shape global = p.shape();
    std::vector<int64_t> starts = b.starts;
    whole_experts(s, name, global, starts);
    add("model/" + name, holder.at(flat_name(name)).contiguous().view(b.shape), global, starts);
    const std::string prefix = fmt::format("state.{}.", k);
    for (const auto& [key, v] : mine) {
      if (!key.starts_with(prefix)) continue;
      const std::string field = key.substr(prefix.size());
      if (field == "step") {
        if (tp_lead && dp_lead) add(fmt::format("optim/{}/step", name), v, v.shape(), {});  // once
        continue;
      }
      StateBlock sb = state_block(s, name, field, v);
      if (!sb.placements[0].is_shard() && !tp_lead) continue;  // whole on tp: written once
      whole_experts(s, name, sb.global, sb.block.starts);
      add(fmt::format("optim/{}/{}", name, field), v.contiguous().view(sb.block.shape), sb.global,
          sb.block.starts);
    }
  }
}

void Gpt3d::read_blocks(const BlockSource& source) {
  Impl& s = *impl_;
  NoGradGuard no_grad;
  nn::StateDict holder_weights;
  std::map<std::string, parallel::LocalBlock> blocks;
  for (const std::string& name : s.holder_order) {
    const parallel::ShardedTensor& p = s.tp->param(name);
    blocks[name] = parallel::local_block(p.shape(), *s.tp_mesh, p.placements());
    Shape global = p.shape();
    std::vector<int64_t> starts = blocks[name].starts;
    whole_experts(s, name, global, starts);
    holder_weights[flat_name(name)] = source.region("model/" + name, global, starts, blocks[name].shape);
  }
  s.zero->load_model_state_dict(holder_weights);
  for (const auto& [name, t] : s.model.named_buffers()) t.copy_(source.whole("model/" + name));

  // The dict of an optimizer over this rank's shards (holder_order), as ZeRO loads it.
  optim::Optimizer::StateDict mine;
  int64_t count[2] = {0, 0};
  const nn::NamedTensors named = s.model.named_parameters();
  const std::map<std::string, Tensor> shapes(named.begin(), named.end());
  for (const std::string& name : s.holder_order) ++count[shapes.at(name).dim() >= 2 ? 0 : 1];
  int64_t next = 0;
  for (int g = 0; g < 2; ++g) {
    std::vector<int64_t> ids;
    for (int64_t j = 0; j < count[g]; ++j) ids.push_back(next++);
    mine[fmt::format("group.{}.params", g)] = Tensor::from_vector<int64_t>(ids, {count[g]});
  }
  for (const char* prefix : {"optim/hparam.", "optim/group."}) {
    for (const std::string& key : source.keys(prefix)) mine[key.substr(6)] = source.whole(key);
  }
  for (size_t k = 0; k < s.holder_order.size(); ++k) {
    const std::string& name = s.holder_order[k];
    const std::string prefix = fmt::format("optim/{}/", name);
    for (const std::string& key : source.keys(prefix)) {
      const std::string field = key.substr(prefix.size());
      Tensor& t = mine[fmt::format("state.{}.{}", k, field)];
      if (field == "step" || (!per_element(s, name, field) && s.o.tp == 1)) {
        t = source.whole(key);  // (with tp 1, per-block or per-row state is whole)
        continue;
      }
      StateBlock sb = state_block(s, name, field, Tensor());
      whole_experts(s, name, sb.global, sb.block.starts);
      t = source.region(key, sb.global, sb.block.starts, sb.block.shape);
      if (!per_element(s, name, field)) t = t.reshape({t.numel()});  // (statistics are 1-D)
    }
  }
  s.zero->load_optimizer_state_dict(*s.opt, mine);
}

}  // namespace tessera::gpt
