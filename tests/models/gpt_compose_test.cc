// Everything composes (tests/models/gpt_3d_cases.h): every technique on every layout of 4
// simulated ranks (threads), in every precision, against the single-device run in that
// precision. CI runs a fixed subset (four configurations per layout and precision, between
// them every value of every axis); the whole matrix runs under
//   bazel test //tests/models:gpt_compose_long_test --test_tag_filters=long
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "parallel/comm/threads.h"
#include "tests/models/gpt_3d_cases.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using namespace testing3d;

// 6 factorisations of 4 ranks (pp, dp, tp): 1x1x4, 1x2x2, 1x4x1, 2x1x2, 2x2x1, 4x1x1.
constexpr int kLayouts = 6, kPrecisions = 4;

int run_on_threads(const std::vector<Combo>& combos) {
  std::vector<int> runs(4);
  parallel::run_threads(4, [&](parallel::CommPtr world) {
    runs[world->rank()] = check_compositions(world, combos);
  });
  for (int r : runs) CHECK(r == runs[0]);  // every rank ran every configuration
  return runs[0];
}

TEST_CASE("composition subset: every axis's values on every layout of 4 ranks, in every precision") {
  const std::vector<Combo> subset = composition_subset(4);
  // Four configurations (everything on; ZeRO 2 + interleaved + full recomputation; ZeRO 1 +
  // sp + GPipe without dropout; plain with dropout) per layout and precision.
  CHECK(subset.size() == kLayouts * kPrecisions * 4);
  CHECK(run_on_threads(subset) == kLayouts * kPrecisions * 4);
}

TEST_CASE("checkpoints across layouts in f64: one device's losses and parameters to 1e-10") {
  const std::string dir = testing::temp_dir() + "/gpt_compose_ckpt";
  std::vector<int> pairs(4);
  parallel::run_threads(4, [&](parallel::CommPtr world) {
    pairs[world->rank()] = check_resume_across_layouts(world, dir);
  });
  // pp2 x dp2 ZeRO 3 -> tp 4 + sp; dp2 x tp2 ZeRO 2 + sp -> pp 4 interleaved (sharded);
  // pp 4 GPipe -> dp 4 ZeRO 1 (sharded); pp2 x tp2 ZeRO 1 -> one device.
  CHECK(pairs == std::vector<int>(4, 4));
}

TEST_CASE("composition matrix: every combination on every layout of 4 ranks, in every precision") {
  std::vector<std::string> skipped;
  const std::vector<Combo> all = composition_matrix(4, &skipped);
  for (const std::string& why : skipped) MESSAGE("skipped: " << why);
  // Per precision: 1x1x4: sp 2 x accum 2 x recompute 3 x dropout 2 = 24; 1x2x2: ZeRO 4 x sp 2
  // x 12 = 96; 1x4x1: ZeRO 4 x 12 = 48; 2x1x2: schedules 3 x sp 2 x 12 = 72; 2x2x1: 3 x ZeRO
  // 4 x 12 = 144; 4x1x1: 3 x 12 = 36 (interleaved's 8 stages fit the 8 pipeline layers).
  // 420 per precision; none impossible on 4 ranks.
  CHECK(skipped.empty());
  CHECK(all.size() == 420 * kPrecisions);
  CHECK(run_on_threads(all) == 420 * kPrecisions);
}

}  // namespace
}  // namespace tessera::gpt
