// The pipeline executor's bubble, measured on the threads backend: each stage's forward
// sleeps F / chunks ms and its backward 2F / chunks ms (sleeping needs no core, so the
// figure is the schedule's and the executor's, not the 2-core machine's), for GPipe, 1F1B
// and interleaved 1F1B over pipeline sizes and micro-batch counts. The bubble is the step's
// wall time over the busy time m (F + 2F), minus one, beside the simulator's and Megatron's
// (p - 1) / m and (1 / v)(p - 1) / m; peak live micro-batch chunks per rank beside. The busy
// time is what each rank actually slept; the bubble is the step's makespan over it, minus
// one, for the rank where that is largest.
//
//   bazel run //tools/bench:pipeline_bench -- --forward_ms=4 --reps=3
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "models/common/flags.h"
#include "parallel/comm/threads.h"
#include "parallel/pipeline/executor.h"
#include "tensor/ops.h"

using namespace tessera;
using namespace tessera::parallel;
using namespace tessera::parallel::pipeline;

namespace {

thread_local double t_busy_ms = 0;  // this rank's time in its stages' work

// Sleeps (a stage's work) and counts the time actually slept as busy: sleep_for overshoots
// by tens of microseconds, which must not count as bubble.
void sleep_ms(double ms) {
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
  t_busy_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One step; returns the largest bubble over the ranks (wall over busy time, minus one) and
// each rank's peak live count.
std::pair<double, std::vector<int>> step(const Schedule& s, double forward_ms) {
  std::vector<double> wall(s.ranks), busy(s.ranks);
  std::vector<int> live(s.ranks);
  const double f = forward_ms / s.chunks, b = 2 * forward_ms / s.chunks;
  run_threads(s.ranks, [&](CommPtr pp) {
    const Tensor w = ones({1}, DType::f32).requires_grad_();
    PipelineChunks chunks(s.chunks, [&](const Tensor& x, int) {
      sleep_ms(f);
      Tensor y = x * w;
      y.register_hook([b](const Tensor&) {
        sleep_ms(b);
        return Tensor();
      });
      return y;
    });
    pp->barrier();
    t_busy_ms = 0;
    const auto t0 = std::chrono::steady_clock::now();
    const PipelineStep r = run_pipeline(
        *pp, s, chunks, [](int) { return ones({4}); },
        [](const Tensor& y, int) { return sum(y); });
    wall[pp->rank()] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    busy[pp->rank()] = t_busy_ms;
    live[pp->rank()] = r.peak_live;
  });
  double bubble = 0;
  const double makespan = *std::max_element(wall.begin(), wall.end());
  for (int r = 0; r < s.ranks; ++r) bubble = std::max(bubble, makespan / busy[r] - 1);
  return {bubble, live};
}

}  // namespace

int main(int argc, char** argv) {
  double forward_ms = 4;
  int64_t reps = 3;
  models::Flags flags("pipeline_bench", "Measured pipeline bubbles on the threads backend.");
  flags.bind("forward_ms", forward_ms, "forward time of one stage on one micro-batch (ms)");
  flags.bind("reps", reps, "steps per configuration (the fastest is reported)");
  try {
    flags.parse(argc, argv);
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  fmt::print("| schedule | p | v | m | measured bubble | simulated | (1/v)(p-1)/m | peak live per rank |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---|\n");
  struct Config {
    std::string name;
    int p, m, v;
  };
  std::vector<Config> configs;
  for (int p : {2, 4, 8}) {
    for (int m : {p, 2 * p, 4 * p}) {
      configs.push_back({"gpipe", p, m, 1});
      configs.push_back({"1f1b", p, m, 1});
      configs.push_back({"interleaved", p, m, 2});
    }
  }
  for (const Config& c : configs) {
    const Schedule s = make_schedule(c.name, c.p, c.m, c.v);
    double best = 1e300;
    std::vector<int> live;
    for (int64_t r = 0; r < reps; ++r) {
      auto [bubble, l] = step(s, forward_ms);
      best = std::min(best, bubble);
      live = l;
    }
    std::string lives;
    for (int l : live) lives += fmt::format("{}{}", lives.empty() ? "" : " ", l);
    fmt::print("| {} | {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {} |\n", c.name, c.p, c.v, c.m,
               best, simulate(s).bubble_fraction,
               static_cast<double>(c.p - 1) / c.m / c.v, lives);
  }
  return 0;
}
