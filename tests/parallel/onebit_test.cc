// The 1-bit compressed all-reduce (parallel/onebit.h) on the threads backend against an
// independent f64 implementation of the algorithm on plain arrays (DeepSpeed's
// compressed_allreduce), with either scale: results and both errors over several rounds; the
// error-feedback identity over worker and server; l1's error never above its input's norm,
// l2's above it on a spiky input; the bytes on the wire by the closed form (about 1/32 of an
// f32 all-reduce's); bad shapes and scale names refused.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/onebit.h"
#include "tensor/ops.h"
#include "tests/parallel/onebit_reference.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_onebit;
using testing::contains;
using testing::error_of;

// Rank r's input at round t: fixed values of both signs, some exactly 0.
Vec input(int r, int t, int64_t n) {
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = i % 17 == 5 ? 0.0 : std::sin(0.61 * static_cast<double>(i) + 1.7 * r - 0.9 * t) * (1.0 + 0.1 * r);
  }
  return v;
}

struct RankResult {
  std::vector<Vec> results;  // per round
  Vec worker, server;        // after the last round
  std::vector<int64_t> bytes;
};

std::vector<RankResult> run(int w, int64_t n, int rounds, OnebitScale scale = OnebitScale::l1) {
  std::vector<RankResult> out(static_cast<size_t>(w));
  run_threads(w, [&](CommPtr world) {
    RankResult& me = out[static_cast<size_t>(world->rank())];
    const Tensor we = zeros({n}, DType::f64), se = zeros({n / w}, DType::f64);
    for (int t = 0; t < rounds; ++t) {
      const Tensor x = Tensor::from_vector<double>(input(world->rank(), t, n), {n});
      CommLog log;
      {
        CommLogScope scope(log);
        onebit_all_reduce(*world, x, we, se, scale);
      }
      me.bytes.push_back(log.bytes());
      me.results.push_back(x.to_vector<double>());
    }
    me.worker = we.to_vector<double>();
    me.server = se.to_vector<double>();
  });
  return out;
}

TEST_CASE("onebit_all_reduce equals an independent f64 1-bit all-reduce, round after round") {
  constexpr int kRounds = 4;
  int configs = 0;
  for (OnebitScale scale : {OnebitScale::l1, OnebitScale::l2}) {
  for (int w : {2, 4}) {
    for (int64_t n : {onebit_padded(1000, w), onebit_padded(64, w)}) {
      CAPTURE(onebit_scale_name(scale));
      CAPTURE(w);
      CAPTURE(n);
      const std::vector<RankResult> got = run(w, n, kRounds, scale);
      RefState st = fresh_state(w, n);
      double worst = 0;
      for (int t = 0; t < kRounds; ++t) {
        std::vector<Vec> x;
        for (int r = 0; r < w; ++r) x.push_back(input(r, t, n));
        const Vec want = reference(x, st, w, scale == OnebitScale::l2);
        for (int r = 0; r < w; ++r) {
          const Vec& have = got[static_cast<size_t>(r)].results[static_cast<size_t>(t)];
          for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::abs(have[i] - want[i]));
        }
      }
      for (int r = 0; r < w; ++r) {
        for (size_t i = 0; i < st.worker[static_cast<size_t>(r)].size(); ++i) {
          worst = std::max(worst, std::abs(got[static_cast<size_t>(r)].worker[i] - st.worker[static_cast<size_t>(r)][i]));
        }
        for (size_t i = 0; i < st.server[static_cast<size_t>(r)].size(); ++i) {
          worst = std::max(worst, std::abs(got[static_cast<size_t>(r)].server[i] - st.server[static_cast<size_t>(r)][i]));
        }
      }
      MESSAGE(std::string(onebit_scale_name(scale)), ", ranks ", w, ", ", n, " elements: largest difference ", worst);
      CHECK(worst <= 1e-13);
      ++configs;
    }
  }
  }
  CHECK(configs == 8);
}

TEST_CASE("onebit_all_reduce's error feedback: results + server error + mean worker error = mean input") {
  // Per round t: result_t = z_t - server_error_t and each rank's compressed y = x + e_{t-1} - e_t,
  // so over T rounds sum_t result_t + server_error_T + mean_r worker_error_T^r is the mean
  // over ranks of the inputs' sum, element by element.
  constexpr int w = 4, kRounds = 6;
  const int64_t n = onebit_padded(500, w), chunk = n / w;
  for (OnebitScale scale : {OnebitScale::l1, OnebitScale::l2}) {
  CAPTURE(onebit_scale_name(scale));
  const std::vector<RankResult> got = run(w, n, kRounds, scale);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    double lhs = 0, want = 0, magnitude = 0;
    for (int t = 0; t < kRounds; ++t) lhs += got[0].results[static_cast<size_t>(t)][static_cast<size_t>(i)];
    lhs += got[static_cast<size_t>(i / chunk)].server[static_cast<size_t>(i % chunk)];
    for (int r = 0; r < w; ++r) {
      lhs += got[static_cast<size_t>(r)].worker[static_cast<size_t>(i)] / w;
      for (int t = 0; t < kRounds; ++t) {
        const double x = input(r, t, n)[static_cast<size_t>(i)];
        want += x / w;
        magnitude += std::abs(x) / w;
      }
    }
    worst = std::max(worst, std::abs(lhs - want) / std::max(magnitude, 1.0));
  }
  MESSAGE(std::string(onebit_scale_name(scale)), ": largest |identity error| / sum|x| = ", worst);
  CHECK(worst <= 1e-14);
  }
}

TEST_CASE("onebit_all_reduce's worker error: l1 never above the input's norm, l2 above it on a spiky input") {
  // One round from zero errors, so y = x: l1 leaves ||x||^2 - (sum |x|)^2 / n exactly, l2
  // ||x||^2 (2 - 2 sum |x| / (sqrt(n) ||x||)). x: one element of 1 per 32, the rest 1e-3
  // (sum |x| / (sqrt(n) ||x||) ~ 0.18 < 1/2), and the smooth input of the other cases.
  constexpr int w = 2;
  const int64_t n = onebit_padded(256, w);
  const auto spiky = [&](int r) {
    Vec v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (i % 32 == r ? 1.0 : 1e-3) * (i % 3 == 0 ? -1.0 : 1.0);
    return v;
  };
  int configs = 0;
  for (bool spikes : {false, true}) {
    for (OnebitScale scale : {OnebitScale::l1, OnebitScale::l2}) {
      CAPTURE(spikes);
      CAPTURE(onebit_scale_name(scale));
      std::vector<Vec> error(static_cast<size_t>(w));
      run_threads(w, [&](CommPtr world) {
        const Vec x = spikes ? spiky(world->rank()) : input(world->rank(), 0, n);
        const Tensor t = Tensor::from_vector<double>(x, {n}), we = zeros({n}, DType::f64),
                     se = zeros({n / w}, DType::f64);
        onebit_all_reduce(*world, t, we, se, scale);
        error[static_cast<size_t>(world->rank())] = we.to_vector<double>();
      });
      for (int r = 0; r < w; ++r) {
        const Vec x = spikes ? spiky(r) : input(r, 0, n);
        double sq = 0, l1 = 0, esq = 0;
        for (size_t i = 0; i < x.size(); ++i) {
          sq += x[i] * x[i];
          l1 += std::abs(x[i]);
          esq += error[static_cast<size_t>(r)][i] * error[static_cast<size_t>(r)][i];
        }
        const double dn = static_cast<double>(n);
        const double want = scale == OnebitScale::l1 ? sq - l1 * l1 / dn
                                                     : sq * (2 - 2 * l1 / (std::sqrt(dn) * std::sqrt(sq)));
        CHECK(std::abs(esq - want) <= 1e-12 * sq);
        if (scale == OnebitScale::l1) CHECK(esq <= sq);
        if (scale == OnebitScale::l2) CHECK((esq > sq) == spikes);
      }
      ++configs;
    }
  }
  CHECK(configs == 4);
}

TEST_CASE("onebit_all_reduce sends n/4 (W-1)/W + 8 (W-1) bytes: about 1/32 of an f32 all-reduce") {
  for (int w : {2, 4}) {
    CAPTURE(w);
    const int64_t n = onebit_padded(1 << 14, w);
    std::vector<int64_t> bytes(static_cast<size_t>(w)), exact(static_cast<size_t>(w));
    run_threads(w, [&](CommPtr world) {
      const Tensor x = Tensor::from_vector<double>(input(world->rank(), 0, n), {n}).cast(DType::f32);
      const Tensor we = zeros({n}), se = zeros({n / w});
      CommLog log;
      {
        CommLogScope scope(log);
        onebit_all_reduce(*world, x, we, se);
      }
      bytes[static_cast<size_t>(world->rank())] = log.bytes();
      log.clear();
      {
        CommLogScope scope(log);
        world->all_reduce(x, ReduceOp::avg);
      }
      exact[static_cast<size_t>(world->rank())] = log.bytes();
    });
    const int64_t formula = n / 4 * (w - 1) / w + 8 * (w - 1);
    CHECK(bytes[0] == formula);
    const double ratio = static_cast<double>(bytes[0]) / static_cast<double>(exact[0]);
    MESSAGE(w, " ranks, ", n, " f32 elements: ", bytes[0], " bytes against the all-reduce's ",
            exact[0], " (", ratio, ")");
    CHECK(std::abs(ratio - 1.0 / 32) <= 0.01 / 32 + 8.0 * w / static_cast<double>(exact[0]));
  }
}

TEST_CASE("onebit_all_reduce_many: bitwise one call per tensor, in 4 collectives, the same bytes") {
  constexpr int kRounds = 3;
  int configs = 0;
  for (OnebitScale scale : {OnebitScale::l1, OnebitScale::l2}) {
  for (int w : {2, 4}) {
    CAPTURE(onebit_scale_name(scale));
    CAPTURE(w);
    const std::vector<int64_t> sizes = {onebit_padded(1000, w), onebit_padded(64, w),
                                        onebit_padded(300, w)};
    // Per rank: every round's results, then both errors, of each tensor; and the log.
    std::vector<std::vector<Vec>> each(static_cast<size_t>(w)), many(static_cast<size_t>(w));
    std::vector<CommLog> each_log(static_cast<size_t>(w)), many_log(static_cast<size_t>(w));
    for (bool batched : {false, true}) {
      run_threads(w, [&](CommPtr world) {
        const size_t r = static_cast<size_t>(world->rank());
        std::vector<Tensor> we, se;
        for (int64_t n : sizes) {
          we.push_back(zeros({n}, DType::f64));
          se.push_back(zeros({n / w}, DType::f64));
        }
        std::vector<Vec>& out = batched ? many[r] : each[r];
        CommLog& log = batched ? many_log[r] : each_log[r];
        for (int t = 0; t < kRounds; ++t) {
          std::vector<Tensor> xs;
          for (size_t k = 0; k < sizes.size(); ++k) {
            xs.push_back(Tensor::from_vector<double>(input(world->rank(), t + 7 * static_cast<int>(k), sizes[k]), {sizes[k]}));
          }
          CommLogScope scope(log);
          if (batched) {
            onebit_all_reduce_many(*world, xs, we, se, scale);
          } else {
            for (size_t k = 0; k < xs.size(); ++k) onebit_all_reduce(*world, xs[k], we[k], se[k], scale);
          }
          for (const Tensor& x : xs) out.push_back(x.to_vector<double>());
        }
        for (size_t k = 0; k < sizes.size(); ++k) {
          out.push_back(we[k].to_vector<double>());
          out.push_back(se[k].to_vector<double>());
        }
      });
    }
    for (int r = 0; r < w; ++r) {
      CHECK(many[static_cast<size_t>(r)] == each[static_cast<size_t>(r)]);
      CHECK(many_log[static_cast<size_t>(r)].records.size() == 4 * kRounds);
      CHECK(each_log[static_cast<size_t>(r)].records.size() == 4 * kRounds * sizes.size());
      CHECK(many_log[static_cast<size_t>(r)].bytes() == each_log[static_cast<size_t>(r)].bytes());
    }
    ++configs;
  }
  }
  CHECK(configs == 4);
}

TEST_CASE("onebit_all_reduce refuses shapes it cannot chunk and unknown scales, naming the values") {
  run_threads(2, [&](CommPtr world) {
    const Tensor x = zeros({20}), we = zeros({20}), se = zeros({10});
    CHECK(contains(error_of([&] { onebit_all_reduce(*world, x, we, se); }),
                   "a multiple of 8 x 2 ranks elements (onebit_padded), got f32 [20]"));
    const Tensor y = zeros({32});
    CHECK(contains(error_of([&] { onebit_all_reduce(*world, y, zeros({32}), zeros({8})); }),
                   "server_error f32 [16]"));
  });
  CHECK(contains(error_of([] { parse_onebit_scale("l3", "gpt: --onebit_scale"); }),
                 "gpt: --onebit_scale: the 1-bit scale must be l1 (mean |x|) or l2 (||x|| / sqrt(n), DeepSpeed's), got 'l3'"));
  CHECK(parse_onebit_scale("l2", "x") == OnebitScale::l2);
  CHECK(onebit_padded(1000, 4) == 1024);
  CHECK(onebit_padded(32, 4) == 32);
  CHECK(onebit_padded(0, 3) == 0);
}

}  // namespace
}  // namespace tessera::parallel
