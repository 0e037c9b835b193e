// How a tensor is laid out over a mesh: one Placement per mesh axis, as PyTorch DTensor.
//   Shard(d)     the tensor's dim d is split into consecutive blocks, one per coordinate
//   Replicate()  every coordinate holds the whole tensor (of this axis' view)
//   Partial(op)  every coordinate holds a term; the value is their sum / mean / max / min
// A dim split over several axes is split by the earlier (outer) axis first, then each block
// by the later axis, as JAX does for PartitionSpec(("dp", "tp")). Partial on several axes
// reduces the last axis' terms first (it matters only when max/min mix with sums).
//
//   Placements p = {Shard(0), Replicate()};          // mesh {dp, tp}: batch over dp
//   Placements q = spec(mesh, {{"dp", "tp"}, {}});   // PartitionSpec style: dim 0 over both
//
// Uneven sizes: a dim of size n over k coordinates gives blocks of n / k, the first n % k of
// them one larger (numpy.array_split; some blocks are empty when n < k).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "parallel/comm/communicator.h"
#include "parallel/mesh.h"
#include "tensor/shape.h"

namespace tessera::parallel {

struct Placement {
  enum class Kind : uint8_t { replicate, shard, partial };
  Kind kind = Kind::replicate;
  int64_t dim = 0;               // shard
  ReduceOp op = ReduceOp::sum;   // partial

  bool is_replicate() const { return kind == Kind::replicate; }
  bool is_shard() const { return kind == Kind::shard; }
  bool is_shard(int64_t d) const { return kind == Kind::shard && dim == d; }
  bool is_partial() const { return kind == Kind::partial; }
  bool is_partial(ReduceOp o) const { return kind == Kind::partial && op == o; }
  std::string str() const;  // "S(0)", "R", "P(sum)"

  friend bool operator==(const Placement& a, const Placement& b) {
    if (a.kind != b.kind) return false;
    if (a.kind == Kind::shard) return a.dim == b.dim;
    if (a.kind == Kind::partial) return a.op == b.op;
    return true;
  }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }
  friend bool operator<(const Placement& a, const Placement& b);
};

inline Placement Shard(int64_t dim) { return Placement{Placement::Kind::shard, dim, ReduceOp::sum}; }
inline Placement Replicate() { return Placement{}; }
inline Placement Partial(ReduceOp op = ReduceOp::sum) {
  return Placement{Placement::Kind::partial, 0, op};
}

using Placements = std::vector<Placement>;  // one per mesh axis
std::string placements_str(const Placements& p);  // "[S(0), R]"

// PartitionSpec style: per tensor dim, the mesh axes it is split over (in mesh order); axes
// not named anywhere are Replicate. Error for unknown or repeated axes, or a spec longer
// than the tensor's rank.
Placements spec(const DeviceMesh& mesh, const std::vector<std::vector<std::string>>& dims,
                int64_t ndim = -1);
// All axes Replicate.
Placements replicated(const DeviceMesh& mesh);

// ---- block arithmetic -------------------------------------------------------------------
// Size and start of block `index` of `size` split into `parts` (array_split).
int64_t block_size(int64_t size, int64_t parts, int64_t index);
int64_t block_start(int64_t size, int64_t parts, int64_t index);

// The block a mesh coordinate holds: its shape and its start in the global tensor.
struct LocalBlock {
  Shape shape;
  std::vector<int64_t> starts;
};
LocalBlock local_block(const Shape& global, const DeviceMesh& mesh, const Placements& p,
                       const std::vector<int64_t>& coords);
inline LocalBlock local_block(const Shape& global, const DeviceMesh& mesh, const Placements& p) {
  return local_block(global, mesh, p, mesh.coordinates());
}

// Validates placements for a tensor of `global` shape on `mesh` (Error naming `op`: a
// placement per axis, Shard dims in range).
void check_placements(const char* op, const DeviceMesh& mesh, const Placements& p,
                      const Shape& global);

}  // namespace tessera::parallel
