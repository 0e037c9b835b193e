// DeviceMesh: the world's ranks arranged as an N-d grid with named axes, as jax.sharding.Mesh
// or torch's DeviceMesh. Ranks are laid out row-major (the last axis varies fastest), and the
// mesh holds one sub-communicator per axis and per set of axes, split from the world once.
//
//   DeviceMesh mesh(world, {{"dp", 2}, {"tp", 4}});   // needs exactly 8 ranks
//   mesh.coordinate("tp");                             // this rank's position along tp
//   mesh.group("tp").all_reduce(t, ReduceOp::sum);     // the 4 ranks sharing our dp index
//
// Constructing a mesh is collective: every rank of the world builds the same mesh, in the
// same order relative to other collectives.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/comm/communicator.h"
#include "tensor/device.h"

namespace tessera::parallel {

struct MeshAxis {
  std::string name;
  int64_t size = 1;
};

class DeviceMesh {
 public:
  // `device` is where this rank's local shards live (kCPU for the threads and MPI backends).
  DeviceMesh(CommPtr world, std::vector<MeshAxis> axes, Device device = kCPU);

  int ndim() const { return static_cast<int>(axes_.size()); }
  int64_t size() const { return numel_; }  // ranks in the mesh
  int64_t size(int axis) const { return axes_.at(axis).size; }
  int64_t size(const std::string& axis) const { return size(axis_index(axis)); }
  const std::string& axis_name(int axis) const { return axes_.at(axis).name; }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  // Error naming the mesh's axes when `name` is not one of them.
  int axis_index(const std::string& name) const;

  int rank() const { return rank_; }  // in the world
  const std::vector<int64_t>& coordinates() const { return coords_; }
  int64_t coordinate(int axis) const { return coords_.at(axis); }
  int64_t coordinate(const std::string& axis) const { return coordinate(axis_index(axis)); }
  int rank_of(const std::vector<int64_t>& coords) const;
  std::vector<int64_t> coordinates_of(int rank) const;

  Device device() const { return device_; }
  const CommPtr& world() const { return world_; }
  // The ranks that differ from this one only along `axis` (named after the axis).
  Communicator& group(int axis) const { return *axis_groups_.at(axis); }
  Communicator& group(const std::string& axis) const { return group(axis_index(axis)); }
  const CommPtr& group_ptr(int axis) const { return axis_groups_.at(axis); }
  // The ranks that differ only along the given axes (named "a,b"); split on first use, which
  // is then collective over the world.
  Communicator& group(const std::vector<std::string>& axes) const;

  // Process-unique identity: tensors on different meshes never mix.
  uint64_t id() const { return id_; }
  // "{dp: 2, tp: 4}"
  std::string str() const;

 private:
  CommPtr world_;
  std::vector<MeshAxis> axes_;
  Device device_;
  int64_t numel_ = 1;
  int rank_ = 0;
  std::vector<int64_t> coords_;
  std::vector<CommPtr> axis_groups_;
  mutable std::map<std::vector<int>, CommPtr> multi_axis_groups_;
  uint64_t id_ = 0;
};

using MeshPtr = std::shared_ptr<const DeviceMesh>;

inline MeshPtr make_mesh(CommPtr world, std::vector<MeshAxis> axes, Device device = kCPU) {
  return std::make_shared<const DeviceMesh>(std::move(world), std::move(axes), device);
}

}  // namespace tessera::parallel
