#include "parallel/tensor_parallel.h"

#include <sstream>

#include "tensor/error.h"

namespace tessera::parallel {

namespace {

std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) out.push_back(part);
  return out;
}

Placements on_axis(const DeviceMesh& mesh, const std::string& axis, Placement p) {
  Placements out(mesh.ndim(), Replicate());
  out[mesh.axis_index(axis)] = p;
  return out;
}

}  // namespace

// ---- plans ---------------------------------------------------------------------------------

TpPlan operator+(TpPlan a, const TpPlan& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

bool path_matches(const std::string& pattern, const std::string& path) {
  const auto p = components(pattern), n = components(path);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] != "*" && p[i] != n[i]) return false;
  }
  return true;
}

TpPlan column_wise(const std::string& linear, int64_t groups) {
  TS_CHECK(groups >= 1, "column_wise: groups must be >= 1 for '{}', got {}", linear, groups);
  const Placement split = Shard(groups > 1 ? 1 : 0);
  return {{linear + ".weight", split, groups}, {linear + ".bias", split, groups}};
}

TpPlan row_wise(const std::string& linear) {
  return {{linear + ".weight", Shard(1)}, {linear + ".bias", Replicate()}};
}

TpPlan vocab_parallel(const std::string& embedding) { return {{embedding + ".weight", Shard(0)}}; }

// ---- applying a plan -----------------------------------------------------------------------

ShardedParameters::ShardedParameters(const nn::Module& module, MeshPtr mesh, const TpPlan& plan,
                                     const std::string& tp_axis,
                                     const std::function<bool(const std::string&)>& keep)
    : mesh_(std::move(mesh)) {
  mesh_->axis_index(tp_axis);  // Error naming the axis when the mesh lacks it
  for (const auto& [name, t] : module.named_parameters()) {
    if (keep && !keep(name)) continue;
    shapes_[name] = t.shape();
    Tensor value = t.detach();
    Placement placement = Replicate();
    for (const TpRule& rule : plan) {
      if (!path_matches(rule.pattern, name)) continue;
      if (rule.groups > 1) {
        TS_CHECK(value.dim() >= 1 && value.size(0) % rule.groups == 0,
                 "ShardedParameters: rule '{}' stacks {} groups in dim 0 of '{}', whose shape {} "
                 "does not divide into them",
                 rule.pattern, rule.groups, name, shape_str(value.shape()));
        Shape v = value.shape();
        v[0] /= rule.groups;
        v.insert(v.begin(), rule.groups);
        value = value.view(v);
      }
      placement = rule.placement;
      break;
    }
    ShardedTensor p = distribute(value.contiguous(), mesh_, on_axis(*mesh_, tp_axis, placement));
    p.requires_grad_();
    params_.emplace(name, p);
  }
  for (const auto& [name, t] : module.named_buffers()) {  // (every one: they share storage)
    buffers_.emplace(name, ShardedTensor(t, mesh_, on_axis(*mesh_, tp_axis, Replicate()), t.shape()));
  }
}

const ShardedTensor& ShardedParameters::operator()(const std::string& path) const {
  if (auto it = params_.find(path); it != params_.end()) return it->second;
  auto it = buffers_.find(path);
  TS_CHECK(it != buffers_.end(), "ShardedParameters: no parameter or buffer '{}'", path);
  return it->second;
}

void ShardedParameters::replace_local(const std::string& path, const Tensor& local) {
  const ShardedTensor& old = (*this)(path);
  TS_CHECK(local.shape() == old.local().shape() && local.dtype() == old.local().dtype(),
           "ShardedParameters::replace_local: '{}' block is {} {}, got {} {}", path,
           shape_str(old.local().shape()), old.local().dtype(), shape_str(local.shape()),
           local.dtype());
  params_.at(path) = ShardedTensor(local, mesh_, old.placements(), old.shape());
}

Tensor ShardedParameters::full_grad(const std::string& path) const {
  const ShardedTensor g = (*this)(path).grad();
  TS_CHECK(g.local().defined(), "ShardedParameters: parameter '{}' has no gradient", path);
  return g.full_tensor().contiguous().view(shapes_.at(path));
}

ModuleParameters::ModuleParameters(const nn::Module& module) {
  for (const auto& [name, t] : module.named_parameters()) params_.emplace(name, t);
  for (const auto& [name, t] : module.named_buffers()) params_.emplace(name, t);
}

const Tensor& ModuleParameters::operator()(const std::string& path) const {
  auto it = params_.find(path);
  TS_CHECK(it != params_.end(), "ModuleParameters: no parameter '{}'", path);
  return it->second;
}

// ---- layouts -------------------------------------------------------------------------------

Tensor SingleDevice::cross_entropy(const Tensor& logits, const Tensor& targets) const {
  return tessera::cross_entropy(logits, targets);
}

TpLayout::TpLayout(MeshPtr mesh, std::string tp_axis, std::string batch_axis)
    : mesh_(std::move(mesh)), tp_axis_(std::move(tp_axis)) {
  mesh_->axis_index(tp_axis_);
  column_.assign(mesh_->ndim(), Replicate());
  for (int a = 0; a < mesh_->ndim(); ++a) {
    if (mesh_->axis_name(a) == batch_axis) column_[a] = Shard(0);
  }
  stream_ = column_;
}

ShardedTensor TpLayout::input(const tessera::Tensor& t) const { return distribute(t, mesh_, column_); }

ShardedTensor TpLayout::replicate(const tessera::Tensor& t) const { return parallel::replicate(t, mesh_); }

ShardedTensor TpLayout::stream(const ShardedTensor& x) const {
  return with_sharding_constraint(x, stream_);
}

// With sequence parallelism this is the all-gather entering the tensor-parallel region;
// without, a no-op.
ShardedTensor TpLayout::column_input(const ShardedTensor& x) const {
  return with_sharding_constraint(x, column_);
}

ShardedTensor TpLayout::wrap_stream(const tessera::Tensor& local, const Shape& global_shape) const {
  return ShardedTensor(local, mesh_, stream_, global_shape);
}

void TpLayout::set_sequence_parallel(bool on, MemoryTracker* region_tracker) {
  region_tracker_ = region_tracker;
  stream_ = column_;
  if (on) stream_[mesh_->axis_index(tp_axis_)] = Shard(1);
}

ShardedTensor TpLayout::cross_entropy(const ShardedTensor& z, const ShardedTensor& t) const {
  TS_CHECK(z.dim() == 2 && t.dim() == 1 && z.shape()[0] == t.shape()[0],
           "TpLayout::cross_entropy: expected logits [N, V] and targets [N], got {} and {}",
           shape_str(z.shape()), shape_str(t.shape()));
  const int64_t V = z.shape()[1];
  // log-sum-exp from a global max (a Partial max over the split vocabulary, reduced) and a
  // global sum of exponentials (a Partial sum); the target's logit from a one-hot mask of
  // the local vocabulary slice (a Partial sum). The max is a constant shift (detached).
  const ShardedTensor m = with_sharding_constraint(max(z, {1}, /*keepdim=*/true).detach(), column_);
  const ShardedTensor lse = log(sum(exp(z - m), {1}, /*keepdim=*/true)) + m;
  const ShardedTensor classes =
      arange(0, static_cast<double>(V), 1, mesh_, on_axis(*mesh_, tp_axis_, Shard(0)), DType::i64);
  const ShardedTensor one_hot =
      cast(call1(OpId::eq, {unsqueeze(t, 1), unsqueeze(classes, 0)}), z.dtype());
  const ShardedTensor target_logit = sum(z * one_hot, {1}, /*keepdim=*/true);
  return with_sharding_constraint(mean(lse - target_logit), Placements(mesh_->ndim(), Replicate()));
}

}  // namespace tessera::parallel
