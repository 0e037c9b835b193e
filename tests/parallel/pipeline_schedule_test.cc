// Pipeline schedules (parallel/pipeline/schedule.h): every generated schedule is valid; the
// simulated bubble fraction is Megatron's (p - 1) / m for GPipe and 1F1B and shrinks with
// the chunks of interleaving; live activations are m per stage for GPipe, p - r for 1F1B;
// the printer's timeline; errors before any work.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <string>

#include "parallel/pipeline/schedule.h"
#include "tests/testing.h"

namespace tessera::parallel::pipeline {
namespace {

using testing::contains;
using testing::error_of;

TEST_CASE("gpipe and 1f1b: valid, bubble (p - 1) / m, live activations m and p - r") {
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 8, 16}) {
      CAPTURE(p);
      CAPTURE(m);
      const Schedule g = gpipe(p, m), f = one_f_one_b(p, m);
      validate(g);
      validate(f);
      const Timeline tg = simulate(g), tf = simulate(f);
      const double want = static_cast<double>(p - 1) / m;
      CHECK(std::abs(tg.bubble_fraction - want) < 1e-12);
      CHECK(std::abs(tf.bubble_fraction - want) < 1e-12);
      CHECK(tg.makespan == doctest::Approx(3.0 * (m + p - 1)));
      for (int r = 0; r < p; ++r) {
        CAPTURE(r);
        CHECK(tg.peak_live[r] == m);
        CHECK(tf.peak_live[r] == std::min(p - r, m));
      }
    }
  }
}

TEST_CASE("interleaved 1f1b: valid, the bubble shrinks by the chunks, live activations bounded") {
  for (int p : {2, 4}) {
    for (int v : {1, 2, 3, 4}) {
      for (int m : {p, 2 * p, 4 * p}) {
        CAPTURE(p);
        CAPTURE(v);
        CAPTURE(m);
        const Schedule s = interleaved_1f1b(p, m, v);
        validate(s);
        const Timeline t = simulate(s);
        const double plain = static_cast<double>(p - 1) / m;
        MESSAGE(fmt::format("p={} v={} m={}: bubble {:.4f}, (1/v)(p-1)/m = {:.4f}", p, v, m,
                            t.bubble_fraction, plain / v));
        CHECK(std::abs(t.bubble_fraction - plain / v) < 1e-12);
        for (int r = 0; r < p; ++r) CHECK(t.peak_live[r] <= m * v);
      }
    }
  }
}

TEST_CASE("the printer draws ranks x time") {
  const std::string got = draw(simulate(one_f_one_b(2, 3)));
  const std::string want =
      "1f1b schedule: 2 ranks, 3 micro-batches; forward 1, backward 2 per micro-batch; bubble 0.333\n"
      "rank 0 |F0 F1 .. .. B0 B0 F2 B1 B1 .. B2 B2|\n"
      "rank 1 |.. F0 B0 B0 F1 B1 B1 F2 B2 B2 .. ..|\n";
  CHECK_MESSAGE(got == want, "got:\n" << got);
}

TEST_CASE("errors come before any work") {
  CHECK(contains(error_of([] { interleaved_1f1b(4, 6, 2); }),
                 "micro-batches (6) must be a multiple of the pipeline ranks (4), e.g. 8"));
  CHECK(contains(error_of([] { make_schedule("zigzag", 2, 4); }),
                 "unknown schedule 'zigzag'; expected gpipe, 1f1b or interleaved"));
  CHECK(contains(error_of([] { make_schedule("1f1b", 2, 4, 2); }),
                 "one model chunk per rank, got 2"));
  CHECK(contains(error_of([] { gpipe(0, 4); }), "must be >= 1"));

  // A forward moved before the receive of its input.
  Schedule s = one_f_one_b(2, 2);
  std::swap(s.actions[1][0], s.actions[1][1]);  // rank 1: forward 0 before recv_activation 0
  CHECK(contains(error_of([&] { validate(s); }),
                 "rank 1 runs forward micro-batch 0 (stage 1) before receiving its input"));
  // Both ranks wait for each other.
  const Schedule d{"custom", 2, 1, 1,
                   {{Action{ActionKind::recv_grad, 0, 0, 1}},
                    {Action{ActionKind::recv_activation, 0, 0, 0}}}};
  CHECK(contains(error_of([&] { simulate(d); }),
                 "pipeline schedule custom: deadlock; rank 0 waits at recv_grad micro-batch 0 "
                 "(stage 0) from rank 1; rank 1 waits at recv_activation micro-batch 0 (stage "
                 "1) from rank 0"));
}

}  // namespace
}  // namespace tessera::parallel::pipeline
