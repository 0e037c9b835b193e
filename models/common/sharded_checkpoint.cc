#include "models/common/sharded_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>

#include <fcntl.h>
#include <unistd.h>

#include "models/common/checkpoint.h"
#include "nn/safetensors.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::models {

namespace fs = std::filesystem;

namespace {

constexpr const char* kBlockPrefix = "block:";  // header metadata: "block:<key>" -> where
constexpr const char* kMetaPrefix = "meta:";     // header metadata: set_metadata's entries

std::string dims_str(const std::vector<int64_t>& d) {
  return fmt::format("{}", fmt::join(d, ","));
}

std::vector<int64_t> parse_dims(const std::string& s, const std::string& what) {
  std::vector<int64_t> out;
  if (s.empty()) return out;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    try {
      out.push_back(std::stoll(part));
    } catch (...) {
      fail("sharded checkpoint: bad dimensions '{}' in {}", s, what);
    }
  }
  return out;
}

void fsync_dir(const std::string& dir);

}  // namespace

void prepare_sharded_checkpoint(const std::string& dir) {
  const std::string tmp = dir + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  TS_CHECK(fs::create_directories(tmp, ec) && !ec,
           "sharded checkpoint: cannot create '{}': {}", tmp, ec.message());
}

void commit_sharded_checkpoint(const std::string& dir) {
  const std::string tmp = dir + ".tmp", prev = dir + ".prev";
  std::error_code ec;
  fs::remove_all(prev, ec);
  if (fs::exists(dir)) {
    fs::rename(dir, prev, ec);
    TS_CHECK(!ec, "sharded checkpoint: cannot move '{}' to '{}': {}", dir, prev, ec.message());
  }
  fs::rename(tmp, dir, ec);
  TS_CHECK(!ec, "sharded checkpoint: cannot move '{}' to '{}': {}", tmp, dir, ec.message());
  fsync_dir(fs::path(dir).parent_path().empty() ? "." : fs::path(dir).parent_path().string());
  fs::remove_all(prev, ec);
}

bool is_sharded_checkpoint(const std::string& path) {
  return fs::is_directory(path) || fs::is_directory(path + ".prev");
}

void check_sharded_checkpoint_path(const std::string& path, const std::string& flag) {
  TS_CHECK(!path.empty(), "{}: the path is empty", flag);
  const fs::path p = fs::path(path).lexically_normal();
  const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
  TS_CHECK(fs::is_directory(parent), "{}={}: directory '{}' does not exist", flag, path,
           parent.string());
  TS_CHECK(!fs::exists(p) || fs::is_directory(p),
           "{}={}: '{}' exists and is not a directory (a sharded checkpoint is one)", flag, path,
           path);
  // The probe: what the save does first, create a directory beside the checkpoint.
  const fs::path probe = fs::path(p.string() + ".probe." + std::to_string(::getpid()));
  std::error_code ec;
  TS_CHECK(fs::create_directory(probe, ec) && !ec, "{}={}: cannot create a directory in '{}': {}",
           flag, path, parent.string(), ec.message());
  fs::remove(probe, ec);
}

ShardedCheckpointWriter::ShardedCheckpointWriter(std::string dir, int rank)
    : dir_(std::move(dir)), rank_(rank) {}

void ShardedCheckpointWriter::add(const std::string& key, const Tensor& block, const Shape& global,
                                  const std::vector<int64_t>& starts) {
  TS_CHECK(tensors_.count(key) == 0, "sharded checkpoint: '{}' added twice on rank {}", key, rank_);
  TS_CHECK(block.dim() == static_cast<int64_t>(global.size()) && starts.size() == global.size(),
           "sharded checkpoint: block {} of '{}' does not fit the global shape {} at [{}]",
           shape_str(block.shape()), key, shape_str(global), dims_str(starts));
  for (size_t d = 0; d < global.size(); ++d) {
    TS_CHECK(starts[d] >= 0 && starts[d] + block.size(static_cast<int64_t>(d)) <= global[d],
             "sharded checkpoint: block {} of '{}' at [{}] leaves the global shape {}",
             shape_str(block.shape()), key, dims_str(starts), shape_str(global));
  }
  const Tensor host = block.device().is_cpu() ? block : block.to(kCPU);
  tensors_[key] = host.contiguous();
  metadata_[kBlockPrefix + key] =
      dims_str(global) + ";" + dims_str(starts) + ";" + dims_str(block.shape());
}

void ShardedCheckpointWriter::add(const std::string& key, const Tensor& whole) {
  add(key, whole, whole.shape(), std::vector<int64_t>(static_cast<size_t>(whole.dim()), 0));
}

void ShardedCheckpointWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[kMetaPrefix + key] = value;
}

void ShardedCheckpointWriter::write() {
  if (tensors_.empty() && metadata_.empty()) return;  // this rank holds nothing to write
  for (const auto& [key, t] : tensors_) {
    if (!is_floating(t.dtype()) || t.numel() == 0) continue;
    TS_CHECK(all_values_finite(t), "sharded checkpoint: '{}' holds NaN or inf (the run "
             "diverged); not writing {} (the checkpoint already there is kept)", key, dir_);
  }
  nn::write_safetensors_file(fmt::format("{}.tmp/rank{}.safetensors", dir_, rank_), tensors_,
                             metadata_);
}

ShardedCheckpointReader::ShardedCheckpointReader(const std::string& path) : dir_(path) {
  if (!fs::is_directory(dir_) && fs::is_directory(path + ".prev")) {
    dir_ = path + ".prev";
    fallback_ = fmt::format("{} is missing (a save was interrupted); loading the previous "
                            "checkpoint {}", path, dir_);
  }
  TS_CHECK(fs::is_directory(dir_), "sharded checkpoint: '{}' is not a directory", path);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("rank") && name.ends_with(".safetensors")) files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  TS_CHECK(!files.empty(), "sharded checkpoint: '{}' holds no rank*.safetensors file", dir_);
  for (const std::string& file : files) {
    for (const auto& [k, v] : nn::read_safetensors_metadata(file)) {
      if (k.starts_with(kMetaPrefix)) {
        metadata_[k.substr(std::string(kMetaPrefix).size())] = v;
        continue;
      }
      if (!k.starts_with(kBlockPrefix)) continue;
      const std::string key = k.substr(std::string(kBlockPrefix).size());
      // "global;starts;block shape"
      const size_t a = v.find(';'), b = a == std::string::npos ? a : v.find(';', a + 1);
      TS_CHECK(b != std::string::npos, "sharded checkpoint: bad block entry '{}' in {}", v, file);
      const Shape global = parse_dims(v.substr(0, a), file);
      const std::vector<int64_t> starts = parse_dims(v.substr(a + 1, b - a - 1), file);
      const Shape shape = parse_dims(v.substr(b + 1), file);
      TS_CHECK(starts.size() == global.size() && shape.size() == global.size(),
               "sharded checkpoint: bad block entry '{}' for '{}' in {}", v, key, file);
      Entry& e = index_[key];
      TS_CHECK(e.blocks.empty() || e.global == global, "sharded checkpoint: '{}' has global "
               "shape {} in one file and {} in {}", key, shape_str(e.global), shape_str(global), file);
      e.global = global;
      e.blocks.push_back({file, shape, starts});
    }
  }
}

Shape ShardedCheckpointReader::global_shape(const std::string& key) const {
  auto it = index_.find(key);
  TS_CHECK(it != index_.end(), "sharded checkpoint: {} has no tensor '{}'", dir_, key);
  return it->second.global;
}

std::vector<std::string> ShardedCheckpointReader::keys(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& [k, e] : index_) {
    if (k.starts_with(prefix)) out.push_back(k);
  }
  return out;
}

const Tensor& ShardedCheckpointReader::block(const std::string& file, const std::string& key) {
  auto it = loaded_.find(file);
  if (it == loaded_.end()) it = loaded_.emplace(file, nn::load_safetensors(file).tensors).first;
  return it->second.at(key);
}

Tensor ShardedCheckpointReader::read(const std::string& key, const std::vector<int64_t>& starts,
                                     const Shape& shape) {
  const Shape global = global_shape(key);
  TS_CHECK(starts.size() == global.size() && shape.size() == global.size(),
           "sharded checkpoint: region {} at [{}] of '{}' does not match its shape {}",
           shape_str(shape), dims_str(starts), key, shape_str(global));
  for (size_t d = 0; d < global.size(); ++d) {
    TS_CHECK(starts[d] >= 0 && shape[d] >= 0 && starts[d] + shape[d] <= global[d],
             "sharded checkpoint: region {} at [{}] leaves the global shape {} of '{}'",
             shape_str(shape), dims_str(starts), shape_str(global), key);
  }
  Tensor out;
  int64_t covered = 0;
  for (const Block& b : index_.at(key).blocks) {
    std::vector<int64_t> lo(global.size()), len(global.size());
    bool overlaps = true;
    for (size_t d = 0; d < global.size(); ++d) {
      lo[d] = std::max(starts[d], b.starts[d]);
      const int64_t hi = std::min(starts[d] + shape[d], b.starts[d] + b.shape[d]);
      len[d] = hi - lo[d];
      overlaps = overlaps && len[d] > 0;
    }
    if (!overlaps && numel_of(shape) > 0) continue;
    Tensor src = block(b.file, key);
    if (!out.defined()) out = zeros(shape, src.dtype());
    Tensor dst = out;
    for (size_t d = 0; d < global.size(); ++d) {
      const int64_t dim = static_cast<int64_t>(d);
      src = src.narrow(dim, lo[d] - b.starts[d], len[d]);
      dst = dst.narrow(dim, lo[d] - starts[d], len[d]);
    }
    dst.copy_(src);
    covered += numel_of(Shape(len.begin(), len.end()));
  }
  // The writers' blocks are disjoint, so full coverage is exactly the region's count.
  TS_CHECK(out.defined() && covered == numel_of(shape),
           "sharded checkpoint: the blocks of '{}' in {} cover {} of the {} elements of region "
           "{} at [{}]", key, dir_, covered, numel_of(shape), shape_str(shape), dims_str(starts));
  return out;
}

Tensor ShardedCheckpointReader::read(const std::string& key) {
  const Shape global = global_shape(key);
  return read(key, std::vector<int64_t>(global.size(), 0), global);
}

namespace {
// The renames are durable once the parent directory's entries are on disk.
void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // nothing to sync through (the rename itself succeeded)
  ::fsync(fd);
  ::close(fd);
}
}  // namespace

}  // namespace tessera::models
