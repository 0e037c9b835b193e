// ShardedTensor: a global tensor laid out over a DeviceMesh (PyTorch's DTensor, a jax.Array
// with a NamedSharding). Each rank holds `local()`, its block under the placements; the
// global shape, mesh and placements say what the blocks add up to. Ops on sharded tensors
// (parallel/ops.h) give the numbers of the same op on one device, with the communication
// derived from the placements (parallel/sharding_rule.h).
//
//   MeshPtr mesh = make_mesh(world, {{"dp", 2}, {"tp", 2}});
//   ShardedTensor x = distribute(randn({8, 16}), mesh, {Shard(0), Replicate()});
//   ShardedTensor w = distribute(randn({16, 4}), mesh, {Replicate(), Shard(1)});
//   ShardedTensor y = matmul(x, w);           // [S(0), S(1)], no communication
//   Tensor full = y.full_tensor();            // all-gathers: the [8, 4] product on every rank
//   std::cout << describe(y);                 // mesh, placements, shard shapes, a block map
//
// Autograd: the local tensors carry the graph. Redistributions are differentiable (their
// backward is the conjugate redistribution), and a replicated input that meets sharded work
// gets its gradient summed over that axis in backward, so the gradient of a Replicate tensor
// is Replicate (Megatron's f/g operators fall out of this).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/mesh.h"
#include "parallel/placement.h"
#include "tensor/tensor.h"

namespace tessera::parallel {

class ShardedTensor {
 public:
  ShardedTensor() = default;  // undefined (an absent optional input)
  // Wraps a local block as is; checks that it has the block's shape for this rank (Error
  // otherwise). Prefer distribute / from_local.
  ShardedTensor(Tensor local, MeshPtr mesh, Placements placements, Shape global_shape);

  bool defined() const { return local_.defined(); }
  const Tensor& local() const { return local_; }
  const MeshPtr& mesh_ptr() const { return mesh_; }
  const DeviceMesh& mesh() const { return *mesh_; }
  const Placements& placements() const { return placements_; }
  const Shape& shape() const { return shape_; }  // global
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return numel_of(shape_); }
  DType dtype() const { return local_.dtype(); }

  bool requires_grad() const { return local_.requires_grad(); }
  ShardedTensor& requires_grad_(bool on = true);
  // The gradient with this tensor's placements (Partial axes read as Replicate: each term's
  // gradient is the whole gradient). Undefined before a backward reached it.
  ShardedTensor grad() const;
  // Backward from a one-element tensor (Replicate, or Partial sum/avg on some axes).
  void backward() const;
  ShardedTensor detach() const;

  // The whole tensor on every rank (a redistribution to Replicate everywhere; differentiable).
  Tensor full_tensor() const;
  // This tensor under other placements (differentiable; collectives as parallel/redistribute.h).
  ShardedTensor redistribute(const Placements& placements) const;

  std::string str() const;  // "ShardedTensor([8, 16] f32, mesh {dp: 2}, [S(0)])"

 private:
  Tensor local_;
  MeshPtr mesh_;
  Placements placements_;
  Shape shape_;
};

// From a tensor every rank holds in full (equal on every rank): each rank keeps its block.
// Partial(sum) leaves the values at mesh coordinate 0 of that axis and zeros elsewhere;
// Partial avg/max/min keep the values on every coordinate.
ShardedTensor distribute(const Tensor& full, const MeshPtr& mesh, const Placements& placements);
// From each rank's local block. Without `global_shape` the shape is found by exchanging
// the local sizes along every sharded axis (Error when the blocks do not form a tensor:
// mismatched ranks, dtypes or non-sharded sizes across ranks); with it, the local shape is
// checked against the block this rank should hold.
ShardedTensor from_local(const Tensor& local, const MeshPtr& mesh, const Placements& placements);
ShardedTensor from_local(const Tensor& local, const MeshPtr& mesh, const Placements& placements,
                         const Shape& global_shape);
// A user's request for a layout inside a model (jax.lax.with_sharding_constraint): the same
// as redistribute, and never a strict-mode violation.
ShardedTensor with_sharding_constraint(const ShardedTensor& t, const Placements& placements);

// Mesh, placements, global and per-rank shard shapes, and for 1-D/2-D tensors an ASCII map
// of which ranks hold which block (like jax.debug.visualize_array_sharding). Local: no
// communication (every rank can compute every block from the placements).
std::string describe(const ShardedTensor& t);

}  // namespace tessera::parallel
