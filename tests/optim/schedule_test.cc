// Learning-rate schedules at the points their definition pins down: warmup start and end,
// the cosine's midpoint and end, and after it.
#include <doctest/doctest.h>

#include <cmath>
#include <numbers>

#include "optim/schedule.h"
#include "tests/optim/optim_test_util.h"

namespace tessera::optim {
namespace {

using testing::expect_error_with;

// The formulas evaluate in f64 with a couple of roundings and one cos: 1e-15 relative.
constexpr double kRel = 1e-15;

TEST_CASE("ConstantLr is constant") {
  const ConstantLr s(3e-4);
  CHECK(s.lr(0) == 3e-4);
  CHECK(s.lr(123456) == 3e-4);
  expect_error_with([] { ConstantLr(-1.0); }, {"ConstantLr", "-1"});
  expect_error_with([&] { s.lr(-1); }, {"ConstantLr", "step -1"});
}

TEST_CASE("WarmupCosineLr: linear warmup from peak / warmup, cosine to min_lr, then min_lr") {
  const double peak = 6e-4, min = 6e-5;
  const WarmupCosineLr s(peak, /*warmup_steps=*/10, /*total_steps=*/110, min);
  CHECK(s.lr(0) == doctest::Approx(peak / 10).epsilon(kRel));  // the first step trains
  CHECK(s.lr(4) == doctest::Approx(peak * 5 / 10).epsilon(kRel));
  CHECK(s.lr(9) == doctest::Approx(peak).epsilon(kRel));   // warmup ends at the peak
  CHECK(s.lr(10) == doctest::Approx(peak).epsilon(kRel));  // cosine starts at the peak
  // Midpoint: r = 50 / 100 = 0.5, cos(pi / 2) = 0: halfway between peak and min.
  CHECK(s.lr(60) == doctest::Approx((peak + min) / 2).epsilon(kRel));
  // A quarter: r = 0.25, (1 + cos(pi / 4)) / 2.
  CHECK(s.lr(35) ==
        doctest::Approx(min + (peak - min) * (1 + std::cos(std::numbers::pi / 4)) / 2)
            .epsilon(kRel));
  CHECK(s.lr(109) > min);
  CHECK(s.lr(109) < min * 1.01);
  CHECK(s.lr(110) == min);
  CHECK(s.lr(100000) == min);
  for (int64_t step = 10; step < 110; ++step) CHECK(s.lr(step + 1) <= s.lr(step));
}

TEST_CASE("WarmupCosineLr without warmup or without decay") {
  const WarmupCosineLr no_warmup(1.0, 0, 4, 0.0);
  CHECK(no_warmup.lr(0) == 1.0);
  CHECK(no_warmup.lr(2) == doctest::Approx(0.5).epsilon(kRel));
  CHECK(no_warmup.lr(4) == 0.0);
  const WarmupCosineLr only_warmup(1.0, 4, 4, 0.1);
  CHECK(only_warmup.lr(0) == 0.25);
  CHECK(only_warmup.lr(3) == 1.0);
  CHECK(only_warmup.lr(4) == 0.1);
}

TEST_CASE("WarmupCosineLr rejects inconsistent settings") {
  expect_error_with([] { WarmupCosineLr(1e-3, 20, 10); },
                    {"WarmupCosineLr", "warmup_steps 20", "total_steps 10"});
  expect_error_with([] { WarmupCosineLr(1e-3, 1, 10, 1e-2); }, {"WarmupCosineLr", "min_lr"});
  expect_error_with([] { WarmupCosineLr(-1e-3, 1, 10); }, {"WarmupCosineLr", "peak_lr"});
  expect_error_with([] { WarmupCosineLr(1e-3, 1, 10).lr(-5); }, {"WarmupCosineLr", "step -5"});
}

}  // namespace
}  // namespace tessera::optim
