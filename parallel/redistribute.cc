#include "parallel/redistribute.h"

#include <fmt/format.h>

#include <numeric>

#include "autograd/node.h"
#include "parallel/comm/comm_log.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

thread_local int strict_depth = 0;

// Partial placements on several axes mean: reduce the last axis' terms first, then the one
// before (only matters when max/min mix with sums).
//
// Preference among the steps available now (lower first): shrink data before moving it.
int step_rank(const Placement& from, const Placement& to) {
  if (from.is_replicate() && to.is_shard()) return 0;  // local slice
  if (from.is_shard() && to.is_partial()) return 1;    // local zero-padding
  if (from.is_partial() && to.is_shard()) return 2;    // reduce_scatter
  if (from.is_shard() && to.is_shard()) return 3;      // all_to_all
  if (from.is_partial() && to.is_replicate()) return 4;  // all_reduce
  if (from.is_shard() && to.is_replicate()) return 5;    // all_gather
  return 6;                                              // replicate -> partial (local)
}

// Whether `from -> to` is one step (else the step goes to Replicate first).
bool direct(const Placement& from, const Placement& to) {
  if (from.is_partial() && to.is_partial()) return false;
  if (from.is_shard() && to.is_partial()) return to.op == ReduceOp::sum;
  return true;
}

// A step on `axis` that splits or joins dims of from/to needs later axes to leave them whole.
// Splitting dim d on `axis` also waits for outer axes that still have to change a split of d
// (they would be blocked by it).
bool legal(const Placements& cur, const Placements& target, int axis, const Placement& from,
           const Placement& to) {
  for (size_t j = axis + 1; j < cur.size(); ++j) {
    if (!cur[j].is_shard()) continue;
    if (from.is_shard(cur[j].dim) || to.is_shard(cur[j].dim)) return false;
  }
  // Mixed Partial kinds are reduced from the last axis to the first (sums and averages
  // commute with each other, max and min only with themselves).
  if (from.is_partial()) {
    const bool linear = from.op == ReduceOp::sum || from.op == ReduceOp::avg;
    for (size_t j = axis + 1; j < cur.size(); ++j) {
      if (!cur[j].is_partial() || cur[j].op == from.op) continue;
      const bool j_linear = cur[j].op == ReduceOp::sum || cur[j].op == ReduceOp::avg;
      if (!(linear && j_linear)) return false;
    }
  }
  if (to.is_shard()) {
    for (int j = 0; j < axis; ++j) {
      if (cur[j] != target[j] && (cur[j].is_shard(to.dim) || target[j].is_shard(to.dim))) {
        return false;
      }
    }
  }
  return true;
}

std::string collective_of(const Placement& from, const Placement& to, int64_t n) {
  if (n == 1) return "local";
  if (from.is_partial() && to.is_replicate()) return "all_reduce";
  if (from.is_partial() && to.is_shard()) return "reduce_scatter";
  if (from.is_shard() && to.is_replicate()) return "all_gather";
  if (from.is_shard() && to.is_shard()) return "all_to_all";
  return "local";
}

// Size of dim d as axis `axis` sees it: the block of the outer axes (this axis unsplit).
int64_t size_before_axis(const DeviceMesh& mesh, const Shape& global, const Placements& cur,
                         int axis, int64_t d) {
  Placements p = cur;
  p[axis] = Replicate();
  return local_block(global, mesh, p).shape[d];
}

int64_t step_bytes(const DeviceMesh& mesh, const Shape& global, DType dt, const Placements& cur,
                   const RedistributeStep& s) {
  const int64_t esize = dtype_size(dt);
  const int64_t n = mesh.size(s.axis);
  const int64_t in_bytes = numel_of(local_block(global, mesh, cur).shape) * esize;
  Placements next = cur;
  next[s.axis] = s.to;
  const int64_t out_bytes = numel_of(local_block(global, mesh, next).shape) * esize;
  if (s.collective == "all_reduce") return all_reduce_wire_bytes(in_bytes, static_cast<int>(n));
  if (s.collective == "all_gather") return all_gather_wire_bytes(in_bytes, static_cast<int>(n));
  if (s.collective == "reduce_scatter") return reduce_scatter_wire_bytes(in_bytes, out_bytes);
  if (s.collective == "all_to_all") {
    // The block that stays: our d-block intersected with our e-block.
    const Shape in_shape = local_block(global, mesh, cur).shape;
    const int64_t e = s.to.dim;
    const int64_t kept = in_shape[e] == 0 ? 0
                                          : numel_of(in_shape) / in_shape[e] *
                                                local_block(global, mesh, next).shape[e];
    return in_bytes - kept * esize;
  }
  return 0;
}

Tensor to_front(const Tensor& t, int64_t d) {
  std::vector<int64_t> order{d};
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i != d) order.push_back(i);
  }
  return contiguous(permute(t, order));
}

Tensor from_front(const Tensor& t, int64_t d) {
  std::vector<int64_t> order;
  for (int64_t i = 1; i <= d; ++i) order.push_back(i);
  order.push_back(0);
  for (int64_t i = d + 1; i < t.dim(); ++i) order.push_back(i);
  return permute(t, order);
}

Shape with_dim(Shape s, int64_t d, int64_t v) {
  s[d] = v;
  return s;
}

}  // namespace

int64_t RedistributePlan::total_bytes() const {
  return std::accumulate(bytes_per_axis.begin(), bytes_per_axis.end(), int64_t{0});
}

std::string RedistributePlan::str() const {
  if (steps.empty()) return "(no steps)";
  std::string s;
  for (const RedistributeStep& st : steps) {
    s += fmt::format("{}axis {}: {} -> {} {} {} B", s.empty() ? "" : "; ", st.axis, st.from.str(),
                     st.to.str(), st.collective, st.bytes);
  }
  return s;
}

RedistributePlan plan_redistribute(const DeviceMesh& mesh, const Shape& global, DType dtype,
                                   const Placements& from, const Placements& to) {
  check_placements("redistribute", mesh, from, global);
  check_placements("redistribute", mesh, to, global);
  RedistributePlan plan;
  plan.bytes_per_axis.assign(mesh.ndim(), 0);
  Placements cur = from;
  for (int guard = 0; cur != to; ++guard) {
    TS_CHECK(guard < 4 * mesh.ndim() + 4, "redistribute: no plan from {} to {} (internal)",
             placements_str(from), placements_str(to));
    int best_axis = -1, best_rank = 1 << 30;
    Placement best_to;
    for (int i = mesh.ndim() - 1; i >= 0; --i) {
      if (cur[i] == to[i]) continue;
      const Placement target = direct(cur[i], to[i]) ? to[i] : Replicate();
      if (!legal(cur, to, i, cur[i], target)) continue;
      const int r = step_rank(cur[i], target);
      if (r < best_rank) best_axis = i, best_rank = r, best_to = target;
    }
    if (best_axis < 0) {
      // Every pending step is blocked by an inner axis splitting the same dim: join the
      // innermost such axis first (nothing inside it can block it).
      for (int j = mesh.ndim() - 1; j >= 0 && best_axis < 0; --j) {
        if (!cur[j].is_shard()) continue;
        for (int i = 0; i < j; ++i) {
          if (cur[i] == to[i]) continue;
          if (cur[i].is_shard(cur[j].dim) || to[i].is_shard(cur[j].dim)) {
            best_axis = j;
            best_to = Replicate();
            break;
          }
        }
      }
      // Or by an inner Partial of another kind that must be reduced before it (it is
      // recreated locally afterwards).
      for (int j = mesh.ndim() - 1; j >= 0 && best_axis < 0; --j) {
        if (!cur[j].is_partial()) continue;
        for (int i = 0; i < j; ++i) {
          if (cur[i] != to[i] && cur[i].is_partial() && cur[i].op != cur[j].op) {
            best_axis = j;
            best_to = Replicate();
            break;
          }
        }
      }
      TS_CHECK(best_axis >= 0, "redistribute: stuck between {} and {} (internal)",
               placements_str(cur), placements_str(to));
    }
    RedistributeStep step{best_axis, cur[best_axis], best_to,
                          collective_of(cur[best_axis], best_to, mesh.size(best_axis)), 0};
    step.bytes = step_bytes(mesh, global, dtype, cur, step);
    plan.bytes_per_axis[best_axis] += step.bytes;
    plan.steps.push_back(step);
    cur[best_axis] = best_to;
  }
  return plan;
}

Tensor redistribute_local(const Tensor& local, const DeviceMesh& mesh, const Shape& global,
                          const Placements& from, const Placements& to, const std::string& cause) {
  const RedistributePlan plan = plan_redistribute(mesh, global, local.dtype(), from, to);
  if (plan.steps.empty()) return local;
  NoGradGuard no_grad;
  CommCause comm_cause(cause);
  Tensor t = local;
  Placements cur = from;
  for (const RedistributeStep& s : plan.steps) {
    const int a = s.axis;
    const int64_t n = mesh.size(a);
    const int64_t c = mesh.coordinate(a);
    Communicator& comm = mesh.group(a);
    const Placement& f = s.from;
    const Placement& g = s.to;
    if (f.is_replicate() && g.is_shard()) {
      const int64_t full = t.size(g.dim);
      t = t.narrow(g.dim, block_start(full, n, c), block_size(full, n, c));
    } else if (f.is_replicate() && g.is_partial()) {
      if (g.op == ReduceOp::sum && c != 0) t = zeros(t.shape(), t.dtype(), t.device());
    } else if (f.is_shard() && g.is_partial()) {
      const int64_t full = size_before_axis(mesh, global, cur, a, f.dim);
      Tensor z = zeros(with_dim(t.shape(), f.dim, full), t.dtype(), t.device());
      z.narrow(f.dim, block_start(full, n, c), block_size(full, n, c)).copy_(t);
      t = z;
    } else if (n == 1) {
      // A one-coordinate axis: every collective is the identity.
    } else if (f.is_partial() && g.is_replicate()) {
      Tensor buf = clone(t);
      comm.all_reduce(buf, f.op);
      t = buf;
    } else if (f.is_partial() && g.is_shard()) {
      const int64_t d = g.dim, full = t.size(d);
      const int64_t inner = full == 0 ? 0 : t.numel() / full;
      std::vector<int64_t> counts(n);
      for (int64_t j = 0; j < n; ++j) counts[j] = block_size(full, n, j) * inner;
      Tensor in = to_front(t, d);
      Tensor out = Tensor::empty(with_dim(in.shape(), 0, block_size(full, n, c)), t.dtype(),
                                 t.device());
      comm.reduce_scatter(out, in, f.op, counts);
      t = from_front(out, d);
    } else if (f.is_shard() && g.is_replicate()) {
      const int64_t d = f.dim;
      const int64_t full = size_before_axis(mesh, global, cur, a, d);
      const int64_t inner = numel_of(with_dim(t.shape(), d, 1));
      std::vector<int64_t> counts(n);
      for (int64_t j = 0; j < n; ++j) counts[j] = block_size(full, n, j) * inner;
      Tensor in = to_front(t, d);
      Tensor out = Tensor::empty(with_dim(in.shape(), 0, full), t.dtype(), t.device());
      comm.all_gather(out, in, counts);
      t = from_front(out, d);
    } else if (f.is_shard() && g.is_shard()) {
      const int64_t d = f.dim, e = g.dim;
      const int64_t full_d = size_before_axis(mesh, global, cur, a, d);
      const int64_t full_e = t.size(e);
      const int64_t my_e = block_size(full_e, n, c);
      // Elements per unit of e in our block, and per unit of (d, e) in every block.
      const int64_t per_e = numel_of(with_dim(t.shape(), e, 1));
      const int64_t per_de = numel_of(with_dim(with_dim(t.shape(), e, 1), d, 1));
      std::vector<int64_t> send(n), recv(n);
      for (int64_t j = 0; j < n; ++j) {
        send[j] = block_size(full_e, n, j) * per_e;
        recv[j] = my_e * block_size(full_d, n, j) * per_de;
      }
      Tensor in = to_front(t, e);  // blocks along e are contiguous runs
      Tensor out = Tensor::empty({std::accumulate(recv.begin(), recv.end(), int64_t{0})},
                                 t.dtype(), t.device());
      comm.all_to_all(out, in, send, recv);
      // Member j's part is its d-block of our e-block, laid out e-first like `in`.
      const int64_t d_front = d < e ? d + 1 : d;  // d's position once e moved to the front
      std::vector<Tensor> parts;
      int64_t offset = 0;
      for (int64_t j = 0; j < n; ++j) {
        Shape part_shape = with_dim(in.shape(), 0, my_e);
        part_shape[d_front] = block_size(full_d, n, j);
        parts.push_back(out.narrow(0, offset, recv[j]).view(part_shape));
        offset += recv[j];
      }
      t = from_front(cat(parts, d_front), e);
    } else {
      fail("redistribute: no step from {} to {} (internal)", f.str(), g.str());
    }
    cur[a] = g;
  }
  return t;
}

namespace {

// How the gradient of a tensor with placements `p` is laid out. The gradient of a value is
// Replicate where the value is Partial. The gradients of the terms of a Partial avg/max/min
// value differ by coordinate (1/n each, or only at the extreme) and the value's gradient is
// their sum: arriving at such an output, they form a Partial sum.
Placements value_grad_placements(const Placements& p) {
  Placements g = p;
  for (Placement& x : g) {
    if (x.is_partial()) x = Replicate();
  }
  return g;
}

Placements term_grad_placements(const Placements& p) {
  Placements g = p;
  for (Placement& x : g) {
    if (x.is_partial()) x = x.is_partial(ReduceOp::sum) ? Replicate() : Partial();
  }
  return g;
}

class RedistributeNode final : public autograd::Node {
 public:
  RedistributeNode(MeshPtr mesh, Shape global, Placements from, Placements to, Shape out_local,
                   DType dtype, Device device, Tensor mask)
      : mesh_(std::move(mesh)), global_(std::move(global)), from_(std::move(from)),
        to_(std::move(to)), out_local_(std::move(out_local)), dtype_(dtype), device_(device),
        mask_(std::move(mask)) {}

  std::string name() const override { return "redistribute"; }
  void release_saved() override { mask_ = Tensor(); }

  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    // Every rank joins the collectives, with zeros when no gradient arrived here.
    Tensor g = grads[0].defined() ? grads[0] : zeros(out_local_, dtype_, device_);
    Tensor out = redistribute_local(g, *mesh_, global_, term_grad_placements(to_),
                                    value_grad_placements(from_), "redistribute backward");
    for (int a = 0; a < mesh_->ndim(); ++a) {
      if (from_[a].is_partial(ReduceOp::avg)) out = out * (1.0 / static_cast<double>(mesh_->size(a)));
    }
    if (mask_.defined()) out = out * mask_;
    return {out};
  }

 private:
  MeshPtr mesh_;
  Shape global_;
  Placements from_, to_;
  Shape out_local_;
  DType dtype_;
  Device device_;
  Tensor mask_;
};

// For Partial max/min sources: the share of the gradient each term gets (1 where it is the
// extreme, split evenly between ties across the axis).
Tensor extreme_mask(const Tensor& local, const MeshPtr& mesh, const Shape& global,
                    const Placements& from) {
  NoGradGuard no_grad;
  Tensor mask;
  for (int a = 0; a < mesh->ndim(); ++a) {
    if (!from[a].is_partial(ReduceOp::max) && !from[a].is_partial(ReduceOp::min)) continue;
    // The value along axis a: the terms with every later Partial axis reduced first.
    Placements inner = from;
    for (int j = a + 1; j < mesh->ndim(); ++j) {
      if (inner[j].is_partial()) inner[j] = Replicate();
    }
    Placements joined = inner;
    joined[a] = Replicate();
    Tensor along = redistribute_local(local, *mesh, global, from, inner, "redistribute (mask)");
    Tensor reduced = redistribute_local(local, *mesh, global, from, joined, "redistribute (mask)");
    Tensor hit = cast(eq(along, reduced), local.dtype());
    Tensor ties = clone(hit);
    {
      CommCause cause("redistribute (mask)");
      mesh->group(a).all_reduce(ties, ReduceOp::sum);
    }
    Tensor m = hit / maximum(ties, ones_like(ties));
    mask = mask.defined() ? mask * m : m;
  }
  return mask;
}

}  // namespace

Tensor redistribute_autograd(const Tensor& local, const MeshPtr& mesh, const Shape& global,
                             const Placements& from, const Placements& to,
                             const std::string& cause) {
  const bool record = GradMode::enabled() && local.requires_grad();
  Tensor mask;
  if (record) mask = extreme_mask(local, mesh, global, from);
  Tensor out = redistribute_local(local, *mesh, global, from, to, cause);
  if (!record || from == to) return out;
  if (out.is_same(local)) out = local.detach();
  auto node = std::make_shared<RedistributeNode>(mesh, global, from, to, out.shape(),
                                                 local.dtype(), local.device(), mask);
  node->mutable_next_edges().push_back(autograd::gradient_edge(local));
  AutogradMeta& meta = out.ensure_autograd_meta();
  meta.grad_fn = node;
  meta.output_nr = 0;
  return out;
}

StrictRedistribution::StrictRedistribution() { ++strict_depth; }
StrictRedistribution::~StrictRedistribution() { --strict_depth; }
bool StrictRedistribution::active() { return strict_depth > 0; }

}  // namespace tessera::parallel
