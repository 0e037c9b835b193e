#include "parallel/mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <set>

#include "tensor/error.h"

namespace tessera::parallel {
namespace {
std::atomic<uint64_t> next_mesh_id{1};
}

DeviceMesh::DeviceMesh(CommPtr world, std::vector<MeshAxis> axes, Device device)
    : world_(std::move(world)), axes_(std::move(axes)), device_(device) {
  TS_CHECK(world_ != nullptr, "DeviceMesh: world communicator is null");
  TS_CHECK(!axes_.empty(), "DeviceMesh: needs at least one axis");
  std::set<std::string> names;
  for (const MeshAxis& a : axes_) {
    TS_CHECK(!a.name.empty(), "DeviceMesh {}: axis names must be non-empty", str());
    TS_CHECK(a.name.find(',') == std::string::npos,
             "DeviceMesh {}: axis name '{}' must not contain ','", str(), a.name);
    TS_CHECK(a.size >= 1, "DeviceMesh {}: axis '{}' has size {}", str(), a.name, a.size);
    TS_CHECK(names.insert(a.name).second, "DeviceMesh {}: axis '{}' appears twice", str(), a.name);
    numel_ *= a.size;
  }
  TS_CHECK(numel_ <= world_->size(),
           "DeviceMesh {}: needs {} ranks but the world ('{}', {}) has only {}", str(), numel_,
           world_->name(), world_->backend(), world_->size());
  TS_CHECK(numel_ == world_->size(),
           "DeviceMesh {}: covers {} ranks but the world ('{}') has {}; build the mesh on a "
           "sub-communicator (Communicator::split) of exactly {} ranks",
           str(), numel_, world_->name(), world_->size(), numel_);
  rank_ = world_->rank();
  coords_ = coordinates_of(rank_);
  // One split per axis: color = the rank with this axis' coordinate zeroed, so the members
  // are the ranks differing only along the axis, ordered by their coordinate on it.
  for (int a = 0; a < ndim(); ++a) {
    std::vector<int64_t> c = coords_;
    c[a] = 0;
    axis_groups_.push_back(
        world_->split(rank_of(c), static_cast<int>(coords_[a]), axes_[a].name));
  }
  id_ = next_mesh_id.fetch_add(1);
}

int DeviceMesh::axis_index(const std::string& name) const {
  for (int a = 0; a < ndim(); ++a) {
    if (axes_[a].name == name) return a;
  }
  fail("DeviceMesh {}: no axis named '{}'", str(), name);
}

int DeviceMesh::rank_of(const std::vector<int64_t>& coords) const {
  TS_CHECK(static_cast<int>(coords.size()) == ndim(), "DeviceMesh {}: {} coordinates for {} axes",
           str(), coords.size(), ndim());
  int64_t r = 0;
  for (int a = 0; a < ndim(); ++a) {
    TS_CHECK(coords[a] >= 0 && coords[a] < axes_[a].size,
             "DeviceMesh {}: coordinate {} out of range on axis '{}'", str(), coords[a],
             axes_[a].name);
    r = r * axes_[a].size + coords[a];
  }
  return static_cast<int>(r);
}

std::vector<int64_t> DeviceMesh::coordinates_of(int rank) const {
  TS_CHECK(rank >= 0 && rank < numel_, "DeviceMesh {}: rank {} out of range", str(), rank);
  std::vector<int64_t> c(axes_.size());
  int64_t r = rank;
  for (int a = ndim() - 1; a >= 0; --a) {
    c[a] = r % axes_[a].size;
    r /= axes_[a].size;
  }
  return c;
}

Communicator& DeviceMesh::group(const std::vector<std::string>& names) const {
  std::vector<int> idx;
  for (const std::string& n : names) idx.push_back(axis_index(n));
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  if (idx.size() == 1) return group(idx[0]);
  auto it = multi_axis_groups_.find(idx);
  if (it != multi_axis_groups_.end()) return *it->second;
  std::vector<int64_t> c = coords_;
  int64_t key = 0;
  std::string name;
  for (int a : idx) {
    c[a] = 0;
    key = key * axes_[a].size + coords_[a];
    name += (name.empty() ? "" : ",") + axes_[a].name;
  }
  CommPtr g = world_->split(rank_of(c), static_cast<int>(key), name);
  multi_axis_groups_.emplace(idx, g);
  return *g;
}

std::string DeviceMesh::str() const {
  std::string s = "{";
  for (size_t a = 0; a < axes_.size(); ++a) {
    s += fmt::format("{}{}: {}", a ? ", " : "", axes_[a].name, axes_[a].size);
  }
  return s + "}";
}

}  // namespace tessera::parallel
