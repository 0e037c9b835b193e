// The sharded op path: global shape inference, a strategy per mesh axis from the op's rule,
// redistribution of inputs, the local op, and the wrapping of the outputs.
#include <fmt/format.h>

#include <limits>

#include "autograd/node.h"
#include "parallel/comm/comm_log.h"
#include "parallel/dispatch.h"
#include "parallel/ops.h"
#include "parallel/redistribute.h"
#include "parallel/sharding_rule.h"
#include "tensor/allocator.h"
#include "tensor/autocast.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

// Rough bytes this rank moves to take one input from `from` to `to` on an axis of size n
// (only used to rank the options; the plan's exact figure comes from plan_redistribute).
double move_cost(const Placement& from, const Placement& to, double bytes, int64_t n) {
  if (from == to || n == 1) return 0.0;
  const double f = static_cast<double>(n - 1) / static_cast<double>(n);
  if (to.is_shard() && from.is_replicate()) return 0.0;
  if (to.is_partial() && from.is_replicate()) return 0.0;
  // Zero-padding a block to a Partial sum moves nothing now but grows it to the full size,
  // and the reduction that must follow costs what an all_gather would.
  if (to.is_partial(ReduceOp::sum) && from.is_shard()) return static_cast<double>(n - 1) * bytes;
  if (to.is_shard() && from.is_partial()) return f * bytes;
  if (to.is_shard() && from.is_shard()) return f * bytes;
  if (to.is_replicate() && from.is_partial()) return 2.0 * f * bytes;
  if (to.is_replicate() && from.is_shard()) return static_cast<double>(n - 1) * bytes;
  // Partial -> other Partial, Shard -> Partial(avg/max/min): through Replicate.
  return from.is_partial() ? 2.0 * f * bytes : static_cast<double>(n - 1) * bytes;
}

// The gradient of a Replicate input used in work that is split or partial on some axes is
// partial over those axes: sum it there in backward (Megatron's "f"), so Replicate tensors
// have Replicate gradients.
class ReplicatedUseNode final : public autograd::Node {
 public:
  ReplicatedUseNode(MeshPtr mesh, std::vector<std::string> axes, Shape shape, DType dtype,
                    std::string cause)
      : mesh_(std::move(mesh)), axes_(std::move(axes)), shape_(std::move(shape)), dtype_(dtype),
        cause_(std::move(cause)) {}
  std::string name() const override { return "replicated_use"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    Tensor g = grads[0].defined() ? tessera::clone(grads[0])
                                  : tessera::zeros(shape_, dtype_, mesh_->device());
    CommCause cause(cause_);
    mesh_->group(axes_).all_reduce(g, ReduceOp::sum);
    return {g};
  }

 private:
  MeshPtr mesh_;
  std::vector<std::string> axes_;
  Shape shape_;
  DType dtype_;
  std::string cause_;
};

Tensor replicated_use(const Tensor& local, const MeshPtr& mesh, std::vector<std::string> axes,
                      OpId op) {
  if (!GradMode::enabled() || !local.requires_grad() || axes.empty()) return local;
  Tensor out = local.detach();
  auto node = std::make_shared<ReplicatedUseNode>(
      mesh, std::move(axes), local.shape(), local.dtype(),
      fmt::format("{} backward (replicated input)", op_name(op)));
  node->mutable_next_edges().push_back(autograd::gradient_edge(local));
  AutogradMeta& meta = out.ensure_autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = 0;
  return out;
}

// A tensor of `shape` with no data, for running view functions on global shapes.
Tensor shape_probe(const TensorSpec& s) {
  // Charged to no MemoryScope: it lives until exit, longer than any rank's tracker (the
  // first caller may be a threads-backend rank with one), which its destructor would
  // otherwise update after that tracker is gone.
  static const Storage empty_storage = [] {
    MemoryScope no_tracker(nullptr);
    return Tensor::empty({0}).storage();
  }();
  return Tensor::from_storage(empty_storage, s.shape, contiguous_strides(s.shape), 0, s.dtype);
}

std::vector<TensorSpec> global_outputs(OpId op, const std::vector<TensorSpec>& in, const Attrs& attrs) {
  const OpInfo& info = op_info(op);
  if (info.kind == OpKind::View) {
    return {TensorSpec::of(view_fn(op)(shape_probe(in[0]), attrs))};
  }
  MetaFn meta = meta_fn(op);
  TS_CHECK(meta != nullptr, "{}: no shape inference registered", op_name(op));
  return meta(in, attrs);
}

// Attrs that name global sizes, made local for this rank's blocks.
Attrs local_attrs(const LocalCtx& c) {
  Attrs a = c.attrs;
  switch (c.op) {
    case OpId::view:
    case OpId::expand:
    case OpId::conv2d_backward_input:
    case OpId::conv2d_backward_weight:
    case OpId::max_pool2d_backward:
      a.shape = local_block(c.out[0].shape, *c.mesh, c.out_placements[0]).shape;
      break;
    case OpId::dropout:
    {
      // The block's place in the sharded tensor, and (inside a batch slice, parallel/ops.cc)
      // the sharded tensor's place in the whole batch.
      const LocalBlock b = local_block(c.in[0].shape, *c.mesh, c.in_placements[0]);
      if (a.rng_view.global_shape.empty()) {
        a.rng_view = RngView{c.in[0].shape, b.starts};
      } else {
        for (size_t d = 0; d < b.starts.size(); ++d) a.rng_view.starts[d] += b.starts[d];
      }
    }
      break;
    default:
      break;
  }
  return a;
}

// An even block's bytes, the same on every rank: the choice must not depend on which rank
// holds a larger (or empty) block, or ranks would pick different layouts.
double block_bytes(const DeviceMesh& mesh, const TensorSpec& spec, const Placements& p) {
  double bytes = static_cast<double>(numel_of(spec.shape)) * static_cast<double>(dtype_size(spec.dtype));
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (p[a].is_shard()) bytes /= static_cast<double>(mesh.size(a));
  }
  return bytes;
}

struct Chosen {
  std::vector<Placements> in, out;
  std::vector<std::vector<std::string>> replicated_axes;  // per input
};

Chosen choose(OpId op, const Attrs& attrs, const DeviceMesh& mesh, const std::vector<TensorSpec>& in,
              const std::vector<TensorSpec>& out, const std::vector<Placements>& current) {
  const ShardingRule* rule = sharding_rule_for(op);
  TS_CHECK(rule != nullptr && rule->options != nullptr,
           "{}: no sharding rule; it cannot run on sharded tensors", op_name(op));
  Chosen ch;
  ch.in.assign(in.size(), Placements(mesh.ndim()));
  ch.out.assign(out.size(), Placements(mesh.ndim()));
  ch.replicated_axes.resize(in.size());
  for (int a = 0; a < mesh.ndim(); ++a) {
    const AxisCtx ctx{op, attrs, a, mesh.size(a), in, out, current, mesh.size()};
    const AxisOptions options = rule->options(ctx);
    TS_CHECK(!options.empty(), "{}: its sharding rule offers no option on mesh axis '{}'",
             op_name(op), mesh.axis_name(a));
    double best = std::numeric_limits<double>::infinity();
    const AxisOption* pick = nullptr;
    for (const AxisOption& o : options) {
      double cost = 0.0;
      for (size_t i = 0; i < in.size(); ++i) {
        if (!in[i].defined) continue;
        const double bytes = block_bytes(mesh, in[i], current[i]);
        cost += move_cost(current[i][a], o.in.at(i), bytes, mesh.size(a));
      }
      if (cost < best) best = cost, pick = &o;
    }
    for (size_t i = 0; i < in.size(); ++i) ch.in[i][a] = in[i].defined ? pick->in.at(i) : Replicate();
    bool split_out = false;
    for (size_t k = 0; k < out.size(); ++k) {
      ch.out[k][a] = pick->out.at(k);
      split_out = split_out || !pick->out.at(k).is_replicate();
    }
    if (split_out && mesh.size(a) > 1) {
      for (size_t i = 0; i < in.size(); ++i) {
        if (in[i].defined && ch.in[i][a].is_replicate()) {
          ch.replicated_axes[i].push_back(mesh.axis_name(a));
        }
      }
    }
  }
  return ch;
}

const MeshPtr& common_mesh(OpId op, const std::vector<ShardedTensor>& inputs) {
  const MeshPtr* mesh = nullptr;
  for (const ShardedTensor& t : inputs) {
    if (!t.defined()) continue;
    if (mesh == nullptr) {
      mesh = &t.mesh_ptr();
    } else if (t.mesh().id() != (*mesh)->id()) {
      fail("{}: inputs live on different meshes, {} (id {}) and {} (id {}); redistribute "
           "them onto one mesh first", op_name(op), (*mesh)->str(), (*mesh)->id(),
           t.mesh().str(), t.mesh().id());
    }
  }
  TS_CHECK(mesh != nullptr, "{}: needs at least one defined sharded input", op_name(op));
  return *mesh;
}

// Chooses the layout and brings every input to it; returns the local inputs.
struct Prepared {
  std::vector<TensorSpec> in, out;
  Chosen chosen;
  std::vector<Tensor> locals;
};

Prepared prepare(OpId op, const std::vector<ShardedTensor>& inputs, const Attrs& attrs,
                 const MeshPtr& mesh, const std::vector<size_t>& written) {
  Prepared p;
  std::vector<Placements> current;
  for (const ShardedTensor& t : inputs) {
    if (t.defined()) {
      p.in.push_back(TensorSpec{t.shape(), t.dtype(), t.local().device(), true});
      current.push_back(t.placements());
    } else {
      p.in.push_back(TensorSpec{{}, DType::f32, kCPU, false});
      current.push_back(replicated(*mesh));
    }
  }
  p.out = global_outputs(op, p.in, attrs);
  p.chosen = choose(op, attrs, *mesh, p.in, p.out, current);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) {
      p.locals.push_back(Tensor());
      continue;
    }
    Tensor local = inputs[i].local();
    const Placements& want = p.chosen.in[i];
    if (want != current[i]) {
      const bool is_written = std::find(written.begin(), written.end(), i) != written.end();
      TS_CHECK(!is_written,
               "{}: input {} is written in place with placements {} but the op needs {}; "
               "redistribute it first", op_name(op), i, placements_str(current[i]),
               placements_str(want));
      if (StrictRedistribution::active()) {
        const RedistributePlan plan =
            plan_redistribute(*mesh, inputs[i].shape(), inputs[i].dtype(), current[i], want);
        fail("{}: strict mode: input {} ({} {}) would be redistributed from {} to {} ({}); "
             "call redistribute() or with_sharding_constraint() explicitly",
             op_name(op), i, shape_str(inputs[i].shape()), inputs[i].dtype(),
             placements_str(current[i]), placements_str(want), plan.str());
      }
      local = redistribute_autograd(local, mesh, inputs[i].shape(), current[i], want,
                                    fmt::format("{} (input {} {} -> {})", op_name(op), i,
                                                placements_str(current[i]), placements_str(want)));
    }
    p.locals.push_back(replicated_use(local, mesh, p.chosen.replicated_axes[i], op));
  }
  return p;
}

}  // namespace

std::vector<ShardedTensor> call(OpId op, const std::vector<ShardedTensor>& given,
                                const Attrs& attrs) {
  const OpInfo& info = op_info(op);
  TS_CHECK(info.kind == OpKind::Compute || info.kind == OpKind::View,
           "parallel::call: {} is not a compute or view op (factories: parallel::factory; "
           "composites: their named function)", op_name(op));
  // Autocast's policy applies to the global tensors, as tessera::call applies it to local
  // ones (shape inference and the rule then see the dtypes the op runs in).
  std::vector<ShardedTensor> cast_inputs;
  if (autocast_enabled()) [[unlikely]] {
    cast_inputs = given;
    autocast_inputs_with(op, cast_inputs, [](const ShardedTensor& t, DType dtype) {
      Attrs a;
      a.dtype = dtype;
      const internal::AutocastCastScope autocast_cast;  // its local casts may be cached
      return call1(OpId::cast, {t}, a);
    });
  }
  const std::vector<ShardedTensor>& inputs = autocast_enabled() ? cast_inputs : given;
  const MeshPtr& mesh = common_mesh(op, inputs);
  Prepared p = prepare(op, inputs, attrs, mesh, {});
  const LocalCtx lctx{op, attrs, mesh, p.in, p.out, p.chosen.in, p.chosen.out, p.locals};
  const ShardingRule* rule = sharding_rule_for(op);
  std::vector<Tensor> local_out;
  CommCause cause(std::string(op_name(op)));
  if (rule->local != nullptr) {
    local_out = rule->local(lctx);
  } else if (op == OpId::view) {
    // A block of a viewable tensor may not be viewable itself (a column block): copy then.
    local_out = {tessera::reshape(p.locals[0], local_attrs(lctx).shape)};
  } else if (info.kind == OpKind::View) {
    local_out = {call_view(op, p.locals[0], local_attrs(lctx))};
  } else {
    local_out = tessera::call(op, p.locals, local_attrs(lctx));
  }
  TS_CHECK(local_out.size() == p.out.size(), "{}: sharded form returned {} outputs, expected {}",
           op_name(op), local_out.size(), p.out.size());
  std::vector<ShardedTensor> result;
  for (size_t k = 0; k < local_out.size(); ++k) {
    if (!local_out[k].defined()) {
      result.emplace_back();
      continue;
    }
    result.emplace_back(local_out[k], mesh, p.chosen.out[k], p.out[k].shape);
  }
  return result;
}

ShardedTensor call1(OpId op, const std::vector<ShardedTensor>& inputs, const Attrs& attrs) {
  return call(op, inputs, attrs).at(0);
}

void call_inplace(OpId op, const std::vector<ShardedTensor>& inputs, const Attrs& attrs,
                  const std::vector<size_t>& written) {
  const MeshPtr& mesh = common_mesh(op, inputs);
  Prepared p = prepare(op, inputs, attrs, mesh, written);
  CommCause cause(std::string(op_name(op)));
  if (op == OpId::copy_) {
    tessera::call_copy_(p.locals.at(0), p.locals.at(1));
  } else {
    tessera::call_inplace(op, p.locals, attrs, written);
  }
}

ShardedTensor factory(OpId op, const Attrs& attrs, const MeshPtr& mesh, const Placements& placements) {
  TS_CHECK(op_info(op).kind == OpKind::Factory, "parallel::factory: {} is not a factory op",
           op_name(op));
  TS_CHECK(mesh != nullptr, "{}: mesh is null", op_name(op));
  const std::vector<TensorSpec> out = global_outputs(op, {}, attrs);
  check_placements(std::string(op_name(op)).c_str(), *mesh, placements, out[0].shape);
  const LocalBlock b = local_block(out[0].shape, *mesh, placements);
  Attrs a = attrs;
  a.device = mesh->device();
  a.shape = b.shape;
  if (op == OpId::rand || op == OpId::randn) {
    a.rng_view = RngView{out[0].shape, b.starts};
  } else if (op == OpId::arange) {
    a.range_start = attrs.range_start + static_cast<double>(b.starts[0]) * attrs.range_step;
    a.range_end = a.range_start + static_cast<double>(b.shape[0]) * attrs.range_step;
    // Round-off could add or drop an element: aim between the last wanted value and the next.
    a.range_end -= 0.5 * attrs.range_step;
  }
  Tensor local = tessera::call1(op, {}, a);
  // Partial placements of a factory: the value sits at coordinate 0 (sum) or everywhere.
  for (int ax = 0; ax < mesh->ndim(); ++ax) {
    if (placements[ax].is_partial(ReduceOp::sum) && mesh->coordinate(ax) != 0) {
      local = tessera::zeros_like(local);
    }
  }
  return ShardedTensor(local, mesh, placements, out[0].shape);
}

ShardedTensor replicate(const Tensor& t, const MeshPtr& mesh) {
  return distribute(t, mesh, replicated(*mesh));
}

}  // namespace tessera::parallel
