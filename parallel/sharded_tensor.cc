#include "parallel/sharded_tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "autograd/engine.h"
#include "parallel/comm/comm_log.h"
#include "parallel/redistribute.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

Placements normalized(const Placements& p, int64_t ndim) {
  Placements out = p;
  for (Placement& x : out) {
    if (x.is_shard() && x.dim < 0 && x.dim >= -ndim) x.dim += ndim;
  }
  return out;
}

Placements grad_placements(const Placements& p) {
  Placements g = p;
  for (Placement& x : g) {
    if (x.is_partial()) x = Replicate();
  }
  return g;
}

}  // namespace

ShardedTensor::ShardedTensor(Tensor local, MeshPtr mesh, Placements placements, Shape global_shape)
    : local_(std::move(local)), mesh_(std::move(mesh)), shape_(std::move(global_shape)) {
  TS_CHECK(local_.defined(), "ShardedTensor: local tensor is undefined");
  TS_CHECK(mesh_ != nullptr, "ShardedTensor: mesh is null");
  placements_ = normalized(placements, static_cast<int64_t>(shape_.size()));
  check_placements("ShardedTensor", *mesh_, placements_, shape_);
  const LocalBlock b = local_block(shape_, *mesh_, placements_);
  TS_CHECK(local_.shape() == b.shape,
           "ShardedTensor: rank {} holds a local block {} but global shape {} under {} on mesh "
           "{} gives it {}", mesh_->rank(), shape_str(local_.shape()), shape_str(shape_),
           placements_str(placements_), mesh_->str(), shape_str(b.shape));
}

int64_t ShardedTensor::size(int64_t d) const {
  const int64_t n = dim();
  TS_CHECK(d >= -n && d < n, "ShardedTensor::size: dim {} out of range for shape {}", d,
           shape_str(shape_));
  return shape_[d < 0 ? d + n : d];
}

ShardedTensor& ShardedTensor::requires_grad_(bool on) {
  local_.requires_grad_(on);
  return *this;
}

ShardedTensor ShardedTensor::grad() const {
  Tensor g = local_.grad();
  if (!g.defined()) return ShardedTensor();
  return ShardedTensor(g, mesh_, grad_placements(placements_), shape_);
}

void ShardedTensor::backward() const {
  TS_CHECK(numel() == 1, "ShardedTensor::backward: needs a one-element tensor, got {}",
           shape_str(shape_));
  double scale = 1.0;
  for (int a = 0; a < mesh_->ndim(); ++a) {
    const Placement& p = placements_[a];
    TS_CHECK(!p.is_partial(ReduceOp::max) && !p.is_partial(ReduceOp::min),
             "ShardedTensor::backward: the loss is {} on mesh axis '{}'; redistribute it to "
             "Replicate first", p.str(), mesh_->axis_name(a));
    if (p.is_partial(ReduceOp::avg)) scale /= static_cast<double>(mesh_->size(a));
  }
  autograd::backward({local_}, {full(local_.shape(), scale, local_.dtype(), local_.device())});
}

ShardedTensor ShardedTensor::detach() const {
  return ShardedTensor(local_.detach(), mesh_, placements_, shape_);
}

Tensor ShardedTensor::full_tensor() const {
  return redistribute_autograd(local_, mesh_, shape_, placements_, replicated(*mesh_),
                               "full_tensor");
}

ShardedTensor ShardedTensor::redistribute(const Placements& placements) const {
  const Placements to = normalized(placements, dim());
  check_placements("redistribute", *mesh_, to, shape_);
  return ShardedTensor(redistribute_autograd(local_, mesh_, shape_, placements_, to), mesh_, to,
                       shape_);
}

std::string ShardedTensor::str() const {
  if (!defined()) return "ShardedTensor(undefined)";
  return fmt::format("ShardedTensor({} {}, mesh {}, {})", shape_str(shape_), dtype(),
                     mesh_->str(), placements_str(placements_));
}

ShardedTensor distribute(const Tensor& full, const MeshPtr& mesh, const Placements& placements) {
  TS_CHECK(full.defined(), "distribute: tensor is undefined");
  TS_CHECK(mesh != nullptr, "distribute: mesh is null");
  const Placements p = normalized(placements, full.dim());
  check_placements("distribute", *mesh, p, full.shape());
  TS_CHECK(full.device() == mesh->device(),
           "distribute: tensor is on {} but the mesh's ranks hold their blocks on {}",
           full.device(), mesh->device());
  Tensor local = redistribute_autograd(full, mesh, full.shape(), replicated(*mesh), p, "distribute");
  return ShardedTensor(clone(local), mesh, p, full.shape());
}

ShardedTensor from_local(const Tensor& local, const MeshPtr& mesh, const Placements& placements,
                         const Shape& global_shape) {
  TS_CHECK(local.defined(), "from_local: tensor is undefined");
  TS_CHECK(mesh != nullptr, "from_local: mesh is null");
  TS_CHECK(local.dim() == static_cast<int64_t>(global_shape.size()),
           "from_local: local block {} and global shape {} differ in rank",
           shape_str(local.shape()), shape_str(global_shape));
  return ShardedTensor(local, mesh, placements, global_shape);
}

ShardedTensor from_local(const Tensor& local, const MeshPtr& mesh, const Placements& placements) {
  TS_CHECK(local.defined(), "from_local: tensor is undefined");
  TS_CHECK(mesh != nullptr, "from_local: mesh is null");
  const Placements p = normalized(placements, local.dim());
  check_placements("from_local", *mesh, p, local.shape());
  // Every rank's (rank, dtype, shape) reaches every rank, so all of them find the same
  // global shape and the same errors (no rank goes on while another throws).
  constexpr int64_t kMaxDims = 16;
  TS_CHECK(local.dim() <= kMaxDims, "from_local: at most {} dims, got {}", kMaxDims, local.dim());
  const int64_t world = mesh->size();
  std::vector<int64_t> mine(kMaxDims + 2, 0);
  mine[0] = local.dim();
  mine[1] = static_cast<int64_t>(local.dtype());
  for (int64_t d = 0; d < local.dim(); ++d) mine[2 + d] = local.size(d);
  Tensor send = Tensor::from_vector(mine, {kMaxDims + 2});
  Tensor all = Tensor::empty({world * (kMaxDims + 2)}, DType::i64);
  {
    CommCause cause("from_local");
    mesh->world()->all_gather(all, send);
  }
  const std::vector<int64_t> v = all.to_vector<int64_t>();
  auto at = [&](int64_t r, int64_t k) { return v[r * (kMaxDims + 2) + k]; };
  for (int64_t r = 0; r < world; ++r) {
    TS_CHECK(at(r, 0) == local.dim() && at(r, 1) == static_cast<int64_t>(local.dtype()),
             "from_local: rank {} holds a {}-d {} block but rank {} a {}-d {} block", r, at(r, 0),
             static_cast<DType>(at(r, 1)), mesh->rank(), local.dim(), local.dtype());
  }
  // Along a dim split over axes A, the ranks at coordinate 0 on every other axis tile it once.
  Shape global(local.dim());
  for (int64_t d = 0; d < local.dim(); ++d) {
    std::vector<int> split_axes;
    for (int a = 0; a < mesh->ndim(); ++a) {
      if (p[a].is_shard(d)) split_axes.push_back(a);
    }
    int64_t total = 0;
    for (int64_t r = 0; r < world; ++r) {
      const std::vector<int64_t> c = mesh->coordinates_of(static_cast<int>(r));
      bool tiles = true;
      for (int a = 0; a < mesh->ndim(); ++a) {
        if (c[a] != 0 && std::find(split_axes.begin(), split_axes.end(), a) == split_axes.end()) {
          tiles = false;
        }
      }
      if (tiles) total += at(r, 2 + d);
    }
    global[d] = total;
  }
  for (int64_t r = 0; r < world; ++r) {
    const LocalBlock b = local_block(global, *mesh, p, mesh->coordinates_of(static_cast<int>(r)));
    Shape got(local.dim());
    for (int64_t d = 0; d < local.dim(); ++d) got[d] = at(r, 2 + d);
    TS_CHECK(got == b.shape,
             "from_local: the local blocks do not form one tensor under {} on mesh {}: rank {} "
             "holds {} but a global shape of {} gives it {} (mismatched global shapes?)",
             placements_str(p), mesh->str(), r, shape_str(got), shape_str(global),
             shape_str(b.shape));
  }
  return ShardedTensor(local, mesh, p, global);
}

ShardedTensor with_sharding_constraint(const ShardedTensor& t, const Placements& placements) {
  TS_CHECK(t.defined(), "with_sharding_constraint: tensor is undefined");
  const Placements to = normalized(placements, t.dim());
  check_placements("with_sharding_constraint", t.mesh(), to, t.shape());
  return ShardedTensor(redistribute_autograd(t.local(), t.mesh_ptr(), t.shape(), t.placements(), to,
                                             "with_sharding_constraint"),
                       t.mesh_ptr(), to, t.shape());
}

namespace {

// The ASCII block map of a 1-D or 2-D tensor: cells at every block boundary, each listing the
// ranks holding it.
std::string block_map(const ShardedTensor& t) {
  const DeviceMesh& mesh = t.mesh();
  const Shape shape2 = t.dim() == 1 ? Shape{1, t.size(0)} : t.shape();
  std::set<int64_t> row_cuts{0, shape2[0]}, col_cuts{0, shape2[1]};
  std::vector<LocalBlock> blocks;
  for (int r = 0; r < mesh.size(); ++r) {
    LocalBlock b = local_block(t.shape(), mesh, t.placements(), mesh.coordinates_of(r));
    if (t.dim() == 1) b = LocalBlock{{1, b.shape[0]}, {0, b.starts[0]}};
    row_cuts.insert(b.starts[0]);
    row_cuts.insert(b.starts[0] + b.shape[0]);
    col_cuts.insert(b.starts[1]);
    col_cuts.insert(b.starts[1] + b.shape[1]);
    blocks.push_back(b);
  }
  const std::vector<int64_t> rows(row_cuts.begin(), row_cuts.end());
  const std::vector<int64_t> cols(col_cuts.begin(), col_cuts.end());
  std::vector<std::vector<std::string>> cell(rows.size() - 1, std::vector<std::string>(cols.size() - 1));
  size_t width = 6;
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    for (size_t j = 0; j + 1 < cols.size(); ++j) {
      std::string s;
      for (int r = 0; r < mesh.size(); ++r) {
        const LocalBlock& b = blocks[r];
        if (b.starts[0] <= rows[i] && rows[i] < b.starts[0] + b.shape[0] &&
            b.starts[1] <= cols[j] && cols[j] < b.starts[1] + b.shape[1]) {
          s += (s.empty() ? "r" : ",r") + std::to_string(r);
        }
      }
      if (s.empty()) s = "-";
      width = std::max(width, s.size() + 2);
      cell[i][j] = s;
    }
  }
  std::string line = "  +";
  for (size_t j = 0; j + 1 < cols.size(); ++j) line += std::string(width, '-') + "+";
  std::string out = line + "\n";
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    out += "  |";
    for (size_t j = 0; j + 1 < cols.size(); ++j) {
      const std::string& s = cell[i][j];
      const size_t left = (width - s.size()) / 2;
      out += std::string(left, ' ') + s + std::string(width - s.size() - left, ' ') + "|";
    }
    out += t.dim() == 1 ? "\n" : fmt::format("  rows {}..{}\n", rows[i], rows[i + 1]);
    out += line + "\n";
  }
  std::string axis = "   ";
  for (size_t j = 0; j + 1 < cols.size(); ++j) {
    axis += fmt::format("{:<{}}", fmt::format("{}..{}", cols[j], cols[j + 1]), width + 1);
  }
  return out + axis + (t.dim() == 1 ? "  (elements)\n" : "  (columns)\n");
}

}  // namespace

std::string describe(const ShardedTensor& t) {
  if (!t.defined()) return "ShardedTensor(undefined)\n";
  const DeviceMesh& mesh = t.mesh();
  std::string out = fmt::format("ShardedTensor {} {} on mesh {}, placements {}\n",
                                shape_str(t.shape()), t.dtype(), mesh.str(),
                                placements_str(t.placements()));
  for (int a = 0; a < mesh.ndim(); ++a) {
    const Placement& p = t.placements()[a];
    if (p.is_partial()) {
      out += fmt::format("  axis '{}': partial — the value is the {} over its {} coordinates\n",
                         mesh.axis_name(a), reduce_op_name(p.op), mesh.size(a));
    }
  }
  for (int r = 0; r < mesh.size(); ++r) {
    const std::vector<int64_t> c = mesh.coordinates_of(r);
    const LocalBlock b = local_block(t.shape(), mesh, t.placements(), c);
    std::string coords;
    for (int a = 0; a < mesh.ndim(); ++a) {
      coords += fmt::format("{}{}={}", a ? ", " : "", mesh.axis_name(a), c[a]);
    }
    out += fmt::format("  rank {} ({}): block {} at [{}]{}\n", r, coords, shape_str(b.shape),
                       fmt::join(b.starts, ", "), r == mesh.rank() ? "  <- this rank" : "");
  }
  if (t.dim() == 1 || t.dim() == 2) out += block_map(t);
  return out;
}

}  // namespace tessera::parallel
