// Sharded checkpoints (models/common/sharded_checkpoint.h): blocks written by several ranks
// read back as any region (assembled across blocks), whole tensors, metadata; a region the
// blocks do not cover, a NaN, and a bad path are errors; an interrupted commit falls back to
// the previous checkpoint.
#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "models/common/sharded_checkpoint.h"
#include "tensor/ops.h"
#include "tests/testing.h"

namespace tessera::models {
namespace {

using testing::contains;
using testing::error_of;
namespace fs = std::filesystem;

Tensor iota(const Shape& shape) {
  std::vector<double> v(static_cast<size_t>(numel_of(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i);
  return Tensor::from_vector<double>(v, shape);
}

// Two writers: rows [0, 2) and [2, 4) of a [4, 6] tensor; rank 0 also a whole tensor.
void write_two_ranks(const std::string& dir, const Tensor& full, double scalar) {
  prepare_sharded_checkpoint(dir);
  for (int rank = 0; rank < 2; ++rank) {
    ShardedCheckpointWriter w(dir, rank);
    w.add("model/w", full.narrow(0, 2 * rank, 2), full.shape(), {2 * rank, 0});
    if (rank == 0) {
      w.add("optim/w/step", Tensor::from_vector<double>({scalar}, {}));
      w.set_metadata("step", "7");
    }
    w.write();
  }
  commit_sharded_checkpoint(dir);
}

TEST_CASE("sharded checkpoints: any region from the blocks that hold it; atomic commits") {
  const std::string dir = testing::temp_dir() + "/sharded_ckpt";
  fs::remove_all(dir);
  const Tensor full = iota({4, 6});
  write_two_ranks(dir, full, 3.0);
  CHECK(is_sharded_checkpoint(dir));
  CHECK(fs::exists(dir + "/rank0.safetensors"));
  CHECK(fs::exists(dir + "/rank1.safetensors"));
  CHECK_FALSE(fs::exists(dir + ".tmp"));
  {
    ShardedCheckpointReader r(dir);
    CHECK(r.fallback_reason().empty());
    CHECK(r.global_shape("model/w") == Shape{4, 6});
    CHECK(r.keys("optim/") == std::vector<std::string>{"optim/w/step"});
    CHECK(r.metadata().at("step") == "7");
    CHECK(r.read("model/w").to_vector<double>() == full.to_vector<double>());
    // Rows 1-2 (one from each block), columns 2-4.
    const Tensor region = r.read("model/w", {1, 2}, {2, 3});
    CHECK(region.to_vector<double>() ==
          full.narrow(0, 1, 2).narrow(1, 2, 3).contiguous().to_vector<double>());
    CHECK(r.read("optim/w/step").item<double>() == 3.0);
    CHECK(contains(error_of([&] { r.read("model/v"); }), "has no tensor 'model/v'"));
    CHECK(contains(error_of([&] { r.read("model/w", {3, 0}, {2, 6}); }),
                   "region [2, 6] at [3,0] leaves the global shape [4, 6] of 'model/w'"));
  }
  // A second save replaces the first whole.
  write_two_ranks(dir, full * 2.0, 4.0);
  CHECK(ShardedCheckpointReader(dir).read("optim/w/step").item<double>() == 4.0);
  CHECK_FALSE(fs::exists(dir + ".prev"));
  // A crash between the commit's two renames leaves only the previous directory: the reader
  // takes it and says so.
  fs::rename(dir, dir + ".prev");
  CHECK(is_sharded_checkpoint(dir));
  {
    ShardedCheckpointReader r(dir);
    CHECK(contains(r.fallback_reason(), "loading the previous checkpoint"));
    CHECK(r.read("model/w").to_vector<double>() == (full * 2.0).to_vector<double>());
  }
  fs::rename(dir + ".prev", dir);
  // Only rank 0's block: a whole read names what is missing.
  const std::string half = dir + "_half";
  prepare_sharded_checkpoint(half);
  {
    ShardedCheckpointWriter w(half, 0);
    w.add("model/w", full.narrow(0, 0, 2), full.shape(), {0, 0});
    w.write();
  }
  commit_sharded_checkpoint(half);
  CHECK(contains(error_of([&] { ShardedCheckpointReader(half).read("model/w"); }),
                 "cover 12 of the 24 elements"));
  // Errors: a NaN is never written; a block outside its tensor; a file where a directory goes.
  prepare_sharded_checkpoint(half);
  ShardedCheckpointWriter bad(half, 0);
  bad.add("model/nan", Tensor::from_vector<double>({1.0, NAN}, {2}));
  CHECK(contains(error_of([&] { bad.write(); }), "'model/nan' holds NaN or inf"));
  ShardedCheckpointWriter outside(half, 1);
  CHECK(contains(error_of([&] { outside.add("model/w", full, full.shape(), {1, 0}); }),
                 "leaves the global shape [4, 6]"));
  CHECK(contains(error_of([&] { check_sharded_checkpoint_path(dir + "/rank0.safetensors", "--save"); }),
                 "exists and is not a directory"));
  CHECK(contains(error_of([&] { check_sharded_checkpoint_path(dir + "/no/such/ckpt", "--save"); }),
                 "does not exist"));
  check_sharded_checkpoint_path(dir, "--save");  // an existing checkpoint is replaced
}

}  // namespace
}  // namespace tessera::models
