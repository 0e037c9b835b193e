#include "parallel/placement.h"

#include <fmt/format.h>

#include <tuple>

#include "tensor/error.h"

namespace tessera::parallel {

bool operator<(const Placement& a, const Placement& b) {
  return std::make_tuple(a.kind, a.is_shard() ? a.dim : 0, a.is_partial() ? a.op : ReduceOp::sum) <
         std::make_tuple(b.kind, b.is_shard() ? b.dim : 0, b.is_partial() ? b.op : ReduceOp::sum);
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::replicate: return "R";
    case Kind::shard: return fmt::format("S({})", dim);
    case Kind::partial: return fmt::format("P({})", reduce_op_name(op));
  }
  return "?";
}

std::string placements_str(const Placements& p) {
  std::string s = "[";
  for (size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + p[i].str();
  return s + "]";
}

Placements replicated(const DeviceMesh& mesh) { return Placements(mesh.ndim(), Replicate()); }

Placements spec(const DeviceMesh& mesh, const std::vector<std::vector<std::string>>& dims,
                int64_t ndim) {
  TS_CHECK(ndim < 0 || static_cast<int64_t>(dims.size()) <= ndim,
           "spec: {} entries for a tensor of rank {}", dims.size(), ndim);
  Placements p = replicated(mesh);
  std::vector<bool> used(mesh.ndim(), false);
  for (size_t d = 0; d < dims.size(); ++d) {
    int last = -1;
    for (const std::string& name : dims[d]) {
      const int a = mesh.axis_index(name);
      TS_CHECK(!used[a], "spec: mesh axis '{}' of {} is used twice", name, mesh.str());
      TS_CHECK(a > last,
               "spec: dim {} lists mesh axes out of mesh order; list them as in {} (outer first)",
               d, mesh.str());
      used[a] = true;
      last = a;
      p[a] = Shard(static_cast<int64_t>(d));
    }
  }
  return p;
}

int64_t block_size(int64_t size, int64_t parts, int64_t index) {
  return size / parts + (index < size % parts ? 1 : 0);
}

int64_t block_start(int64_t size, int64_t parts, int64_t index) {
  const int64_t base = size / parts, extra = size % parts;
  return index * base + std::min(index, extra);
}

LocalBlock local_block(const Shape& global, const DeviceMesh& mesh, const Placements& p,
                       const std::vector<int64_t>& coords) {
  LocalBlock b{global, std::vector<int64_t>(global.size(), 0)};
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (!p[a].is_shard()) continue;
    const int64_t d = p[a].dim;
    const int64_t n = mesh.size(a);
    b.starts[d] += block_start(b.shape[d], n, coords[a]);
    b.shape[d] = block_size(b.shape[d], n, coords[a]);
  }
  return b;
}

void check_placements(const char* op, const DeviceMesh& mesh, const Placements& p,
                      const Shape& global) {
  TS_CHECK(static_cast<int>(p.size()) == mesh.ndim(),
           "{}: {} placements {} for mesh {} of {} axes", op, p.size(), placements_str(p),
           mesh.str(), mesh.ndim());
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (!p[a].is_shard()) continue;
    TS_CHECK(p[a].dim >= 0 && p[a].dim < static_cast<int64_t>(global.size()),
             "{}: Shard({}) on mesh axis '{}' is out of range for a tensor of shape {}", op,
             p[a].dim, mesh.axis_name(a), shape_str(global));
  }
}

}  // namespace tessera::parallel
