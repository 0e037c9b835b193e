#include "models/gpt/tensor_parallel.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "tensor/error.h"

namespace tessera::gpt {

namespace {

using parallel::Placements;
using parallel::ShardedTensor;

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) out.push_back(part);
  return out;
}

bool matches(const std::string& pattern, const std::string& name) {
  const auto p = components(pattern), n = components(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != "*" && p[i] != n[i]) return false;
  }
  return true;
}

ShardedTensor linear(const ShardedTensor& x, const ShardedTensor& w, const ShardedTensor& b) {
  return parallel::matmul(x, parallel::transpose(w, 0, 1)) + b;
}

}  // namespace

TpPlan megatron_plan() {
  using parallel::Shard;
  return {
      // Column-parallel: output features split. The qkv weight is viewed [3, C, C] so that
      // each rank holds the q, k and v rows of its own heads.
      {"h.*.attn.c_attn.weight", {3, -1, -1}, Shard(1)},
      {"h.*.attn.c_attn.bias", {3, -1}, Shard(1)},
      {"h.*.mlp.c_fc.weight", {}, Shard(0)},
      {"h.*.mlp.c_fc.bias", {}, Shard(0)},
      // Vocab-parallel: the token embedding's rows (the lookup is a masked local gather, a
      // Partial sum) and, tied, the LM head's output features (logits split over the vocab).
      {"wte.weight", {}, Shard(0)},
      // Row-parallel: input features split; the product is Partial.
      {"h.*.attn.c_proj.weight", {}, Shard(1)},
      {"h.*.mlp.c_proj.weight", {}, Shard(1)},
  };
}

TpGpt::TpGpt(const Gpt& model, parallel::MeshPtr mesh, TpPlan plan, std::string tp_axis,
             std::string batch_axis, const std::function<bool(const std::string&)>& keep)
    : config_(model.config()), mesh_(std::move(mesh)), tp_axis_(std::move(tp_axis)),
      batch_axis_(std::move(batch_axis)) {
  const int64_t tp = mesh_->size(tp_axis_);
  TS_CHECK(config_.heads % tp == 0,
           "TpGpt: heads ({}) must be divisible by the tp size ({}): each rank computes whole "
           "heads; tp must divide {}",
           config_.heads, tp, config_.heads);
  const int tp_index = mesh_->axis_index(tp_axis_);
  column_placements_.assign(mesh_->ndim(), parallel::Replicate());
  for (int a = 0; a < mesh_->ndim(); ++a) {
    if (mesh_->axis_name(a) == batch_axis_) column_placements_[a] = parallel::Shard(0);
  }
  stream_placements_ = column_placements_;
  const int64_t C = config_.width;
  for (const auto& [name, t] : model.named_parameters()) {
    if (keep && !keep(name)) continue;
    shapes_[name] = t.shape();
    Placements placements(mesh_->ndim(), parallel::Replicate());
    Tensor value = t.detach();
    for (const TpSpec& spec : plan) {
      if (!matches(spec.pattern, name)) continue;
      if (!spec.view.empty()) {
        Shape v = spec.view;
        for (int64_t& d : v) d = d < 0 ? C : d;
        value = value.view(v);
      }
      placements[tp_index] = spec.placement;
      break;
    }
    ShardedTensor p = parallel::distribute(value.contiguous(), mesh_, placements);
    p.requires_grad_();
    params_.emplace(name, p);
  }
}

const ShardedTensor& TpGpt::param(const std::string& name) const {
  auto it = params_.find(name);
  TS_CHECK(it != params_.end(), "TpGpt: no parameter '{}'", name);
  return it->second;
}

void TpGpt::replace_local(const std::string& name, const Tensor& local) {
  const ShardedTensor& old = param(name);
  TS_CHECK(local.shape() == old.local().shape() && local.dtype() == old.local().dtype(),
           "TpGpt::replace_local: '{}' block is {} {}, got {} {}", name,
           shape_str(old.local().shape()), old.local().dtype(), shape_str(local.shape()),
           local.dtype());
  params_.at(name) = ShardedTensor(local, mesh_, old.placements(), old.shape());
}

Tensor TpGpt::full_grad(const std::string& name) const {
  const ShardedTensor g = param(name).grad();
  TS_CHECK(g.local().defined(), "TpGpt: parameter '{}' has no gradient", name);
  return g.full_tensor().contiguous().view(shapes_.at(name));
}

ShardedTensor TpGpt::input(const Tensor& t) const {
  return parallel::distribute(t, mesh_, column_placements_);
}

// The residual stream's layout: batch split over dp (when the mesh has it); on tp whole, or
// with sequence parallelism split along the sequence.
ShardedTensor TpGpt::to_stream(const ShardedTensor& x) const {
  return parallel::with_sharding_constraint(x, stream_placements_);
}

// What a column-parallel product (and the head) takes: the stream whole on tp. With sequence
// parallelism this is the all-gather entering the tensor-parallel region; without, a no-op.
ShardedTensor TpGpt::column_input(const ShardedTensor& x) const {
  return parallel::with_sharding_constraint(x, column_placements_);
}

ShardedTensor TpGpt::region(const std::function<ShardedTensor()>& fn) const {
  if (region_tracker_ == nullptr) return fn();
  MemoryScope scope(region_tracker_);
  return fn();
}

void TpGpt::set_sequence_parallel(bool on, MemoryTracker* region_tracker) {
  sequence_parallel_ = on;
  region_tracker_ = region_tracker;
  stream_placements_ = column_placements_;
  if (on) stream_placements_[mesh_->axis_index(tp_axis_)] = parallel::Shard(1);
}

ShardedTensor TpGpt::attention(int64_t i, const ShardedTensor& x) {
  const std::string p = fmt::format("h.{}.attn.", i);
  const int64_t B = x.shape()[0], T = x.shape()[1], C = config_.width;
  const int64_t H = config_.heads, hd = C / H;
  const ShardedTensor& w3 = param(p + "c_attn.weight");  // [3, C, C]: rows split on tp
  const ShardedTensor& b3 = param(p + "c_attn.bias");    // [3, C]
  // One column-parallel product for q, k and v: [B, 1, T, C] @ [3, C, C]^T -> [B, 3, T, C],
  // its last dim split (each rank: its heads' q, k and v).
  const ShardedTensor qkv =
      parallel::matmul(parallel::unsqueeze(column_input(x), 1), parallel::transpose(w3, 1, 2)) +
      parallel::unsqueeze(b3, 1);
  auto heads_first = [&](int64_t k) {
    const ShardedTensor t = parallel::squeeze(parallel::slice(qkv, 1, k, k + 1), {1});
    // [B, T, C] -> [B, H, T, hd]: the split of C (whole heads) becomes a split of H.
    return parallel::transpose(parallel::view(t, {B, T, H, hd}), 1, 2);
  };
  const ShardedTensor q = heads_first(0), k = heads_first(1), v = heads_first(2);
  ShardedTensor scores =
      parallel::matmul(q, parallel::transpose(k, 2, 3)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  const Tensor pos = arange(0, static_cast<double>(T), 1, DType::i64);
  const ShardedTensor mask = parallel::replicate(ge(pos.view({T, 1}), pos.view({1, T})), mesh_);
  const ShardedTensor neg_inf = parallel::full({}, -std::numeric_limits<double>::infinity(), mesh_,
                                               Placements(mesh_->ndim(), parallel::Replicate()),
                                               scores.local().dtype());
  scores = parallel::call1(OpId::where, {mask, scores, neg_inf});
  const ShardedTensor weights =
      parallel::dropout(parallel::softmax(scores, -1), config_.dropout, training_);
  const ShardedTensor y = parallel::matmul(weights, v);  // [B, H, T, hd]
  const ShardedTensor merged = parallel::view(
      parallel::call1(OpId::clone, {parallel::transpose(y, 1, 2)}), {B, T, C});
  // Row-parallel: the product is Partial over tp; the residual stream wants it whole (the
  // all-reduce), then the bias joins once.
  const ShardedTensor out = to_stream(
      parallel::matmul(merged, parallel::transpose(param(p + "c_proj.weight"), 0, 1)));
  return region([&] { return parallel::dropout(out + param(p + "c_proj.bias"), config_.dropout, training_); });
}

ShardedTensor TpGpt::block(int64_t i, const ShardedTensor& x) {
  const std::string p = fmt::format("h.{}.", i);
  const Shape c{config_.width};
  // The LayerNorm and residual regions run on the stream's layout (with sequence
  // parallelism, each rank its part of the sequence); `region` accounts their memory.
  const ShardedTensor n1 = region([&] {
    return parallel::layer_norm(x, c, param(p + "ln_1.weight"), param(p + "ln_1.bias"));
  });
  const ShardedTensor a = attention(i, n1);
  const ShardedTensor h = region([&] { return x + a; });
  const ShardedTensor n2 = region([&] {
    return parallel::layer_norm(h, c, param(p + "ln_2.weight"), param(p + "ln_2.bias"));
  });
  const ShardedTensor up = parallel::gelu(
      linear(column_input(n2), param(p + "mlp.c_fc.weight"), param(p + "mlp.c_fc.bias")),
      /*approximate_tanh=*/true);
  const ShardedTensor down = region([&] {
    return parallel::dropout(
        to_stream(parallel::matmul(up, parallel::transpose(param(p + "mlp.c_proj.weight"), 0, 1))) +
            param(p + "mlp.c_proj.bias"),
        config_.dropout, training_);
  });
  return region([&] { return h + down; });
}

ShardedTensor TpGpt::embed(const Tensor& idx) {
  TS_CHECK(idx.defined() && idx.dim() == 2 && idx.dtype() == DType::i64,
           "TpGpt: expected idx [B, T] i64, got {}", idx.defined() ? shape_str(idx.shape()) : "undefined");
  const int64_t T = idx.size(1);
  const ShardedTensor pos =
      parallel::replicate(arange(0, static_cast<double>(T), 1, DType::i64), mesh_);
  const ShardedTensor x = to_stream(parallel::embedding(param("wte.weight"), input(idx)) +
                                    parallel::embedding(param("wpe.weight"), pos));
  return region([&] { return parallel::dropout(x, config_.dropout, training_); });
}

ShardedTensor TpGpt::head(const ShardedTensor& x) {
  const ShardedTensor n = region([&] {
    return parallel::layer_norm(x, {config_.width}, param("ln_f.weight"), param("ln_f.bias"));
  });
  return parallel::matmul(column_input(n), parallel::transpose(param("wte.weight"), 0, 1));
}

ShardedTensor TpGpt::stream(const Tensor& x, const Shape& global_shape) const {
  return ShardedTensor(x, mesh_, stream_placements_, global_shape);
}

ShardedTensor TpGpt::forward(const Tensor& idx) {
  ShardedTensor x = embed(idx);
  for (int64_t i = 0; i < config_.layers; ++i) x = block(i, x);
  return head(x);
}

ShardedTensor TpGpt::loss(const Tensor& idx, const Tensor& targets) {
  return vocab_parallel_loss(forward(idx), targets);
}

ShardedTensor TpGpt::vocab_parallel_loss(const ShardedTensor& logits, const Tensor& targets) {
  const int64_t rows = targets.size(0) * targets.size(1), V = config_.vocab;
  const ShardedTensor z = parallel::view(logits, {rows, V});  // vocab split over tp
  const ShardedTensor t = parallel::view(input(targets), {rows});
  // Mean cross-entropy without the full logits on any rank: log-sum-exp from a global max
  // (a Partial max over the split vocab, reduced) and a global sum of exponentials (a
  // Partial sum), and the target's logit from a one-hot mask of the local vocabulary slice
  // (a Partial sum). The max is a constant shift (detached), as in any log-sum-exp.
  const ShardedTensor m = parallel::with_sharding_constraint(
      parallel::max(z, {1}, /*keepdim=*/true).detach(), column_placements_);
  const ShardedTensor lse =
      parallel::log(parallel::sum(parallel::exp(z - m), {1}, /*keepdim=*/true)) + m;
  Placements split_vocab(mesh_->ndim(), parallel::Replicate());
  split_vocab[mesh_->axis_index(tp_axis_)] = parallel::Shard(0);
  const ShardedTensor classes =
      parallel::arange(0, static_cast<double>(V), 1, mesh_, split_vocab, DType::i64);
  const ShardedTensor one_hot = parallel::cast(
      parallel::call1(OpId::eq, {parallel::unsqueeze(t, 1), parallel::unsqueeze(classes, 0)}),
      z.dtype());
  const ShardedTensor target_logit = parallel::sum(z * one_hot, {1}, /*keepdim=*/true);
  // A scalar, whole on every rank (a pipeline's last stage reads its local value).
  return parallel::with_sharding_constraint(parallel::mean(lse - target_logit),
                                            Placements(mesh_->ndim(), parallel::Replicate()));
}

}  // namespace tessera::gpt
