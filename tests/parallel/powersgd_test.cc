// PowerSGD (parallel/powersgd.h) as DDP's comm hook on the threads backend, against an
// independent f64 implementation of the algorithm written here on plain arrays (the same
// initial Q, given through PowerSgdOptions::initial_q): each rank's reduced gradients and the
// warm-start Qs per round; the error-feedback identity; the bytes on the wire (comm log)
// against the closed form; exact rounds before start_iter; bitwise resume from the hook's
// state dict; options and state dicts refused with the value named; and PyTorch's own
// powerSGD_hook (tools/powersgd_peer.py) on the same gradients and initial Qs.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <memory>
#include <string>
#include <vector>

#include "parallel/comm/threads.h"
#include "parallel/powersgd.h"
#include "parallel/zero.h"
#include "tensor/ops.h"
#include "tests/parallel/powersgd_reference.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_powersgd;
using testing::contains;
using testing::error_of;

// run_rank on `ranks` threads.
std::vector<RankRun> run_ddp(int ranks, int first, int rounds, const PowerSgdOptions& options,
                             const std::vector<std::map<std::string, Tensor>>* load = nullptr,
                             int64_t bucket_bytes = int64_t{25} << 20, bool average = true) {
  std::vector<RankRun> out(static_cast<size_t>(ranks));
  run_threads(ranks, [&](CommPtr world) {
    const size_t r = static_cast<size_t>(world->rank());
    out[r] = run_rank(*world, first, rounds, options, load ? &(*load)[r] : nullptr, bucket_bytes,
                      average);
  });
  return out;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

TEST_CASE("PowerSGD on DDP equals an independent f64 PowerSGD: gradients, Qs, error feedback") {
  // One bucket, and buckets of 600 bytes (the kernel, w3 with the bias, w1: three buckets,
  // whose P all-reduces are in flight together while the first's Q is reduced).
  constexpr int kRounds = 6;
  constexpr int64_t kStart = 2;
  int configs = 0;
  for (int ranks : {2, 4}) {
    for (int64_t rank : {1, 2}) {
      for (int64_t bucket_bytes : {int64_t{25} << 20, int64_t{600}}) {
        CAPTURE(ranks);
        CAPTURE(rank);
        CAPTURE(bucket_bytes);
        PowerSgdOptions o{.rank = rank, .start_iter = kStart, .initial_q = q0_of};
        const std::vector<RankRun> runs = run_ddp(ranks, 0, kRounds, o, nullptr, bucket_bytes);
        int buckets = 0;
        for (const auto& [name, place] : runs[0].places) buckets = std::max(buckets, place.first + 1);
        CHECK(buckets == (bucket_bytes == 600 ? 3 : 1));
        std::vector<RefParam> ref = ref_params(ranks, rank);
        CHECK(ref[0].compressed);
        CHECK_FALSE(ref[1].compressed);
        CHECK_FALSE(ref[2].compressed);
        CHECK(ref[3].compressed);
        const auto want = reference(ref, ranks, kRounds, kStart, runs[0].places);
        double worst = 0;
        for (const RankRun& run : runs) worst = std::max(worst, worst_relative(run.grads, want));
        MESSAGE("ranks ", ranks, " rank ", rank, " buckets ", buckets,
                ": largest relative difference ", worst);
        CHECK(worst <= 1e-12);
        // The warm-start Qs after the last round.
        for (const RefParam& p : ref) {
          CAPTURE(p.name);
          const auto [bucket, index] = runs[0].places.at(p.name);
          const std::string key = fmt::format("q.{}.{}", bucket, index);
          if (p.compressed) {
            const std::vector<double> q = runs[0].state.at(key).to_vector<double>();
            REQUIRE(q.size() == p.q.size());
            for (size_t i = 0; i < q.size(); ++i) CHECK(std::abs(q[i] - p.q[i]) <= 1e-12 * max_abs(p.q));
          } else {
            CHECK(runs[0].state.count(key) == 0);
          }
        }
        ++configs;
      }
    }
  }
  CHECK(configs == 8);
}

TEST_CASE("PowerSGD summing (DdpOptions::average false): the group size times the mean's result") {
  // What gpt runs (each rank's loss is its share of the global mean, reduced by a sum): the
  // Ps and Qs are summed, the result is the sum, and each rank's error is its input minus
  // the result over the group size, so every round is the averaging run's times the size.
  const PowerSgdOptions o{.rank = 1, .start_iter = 1, .initial_q = q0_of};
  const std::vector<RankRun> sum = run_ddp(4, 0, 6, o, nullptr, int64_t{25} << 20, false);
  std::vector<RefParam> ref = ref_params(4, 1);
  std::vector<std::vector<Mat>> want = reference(ref, 4, 6, 1, sum[0].places);
  for (auto& round : want) {
    for (Mat& m : round) {
      for (double& v : m) v *= 4;
    }
  }
  double worst = 0;
  for (const RankRun& run : sum) worst = std::max(worst, worst_relative(run.grads, want));
  MESSAGE("summing over 4 ranks: largest relative difference from 4 x the mean's ", worst);
  CHECK(worst <= 1e-12);
}

TEST_CASE("PowerSGD's error feedback: what each rank applied plus its last error is the sum of its gradients") {
  // From the first compressed round the error is the input minus the result, so over T rounds
  // sum(result_t) + error_T = sum(gradient_t) on every rank, whatever was compressed.
  constexpr int kRounds = 5;
  const std::vector<RankRun> runs =
      run_ddp(2, 0, kRounds, {.rank = 1, .start_iter = 0, .initial_q = q0_of});
  for (int w = 0; w < 2; ++w) {
    CAPTURE(w);
    const RankRun& run = runs[static_cast<size_t>(w)];
    const std::vector<double> error = run.state.at("error.0").to_vector<double>();
    // The bucket holds the parameters in reverse registration order.
    const auto shapes = Params::shapes();
    std::vector<size_t> order;
    for (const std::string& name : run.bucket_names) {
      for (size_t k = 0; k < shapes.size(); ++k) {
        if (shapes[k].first == name) order.push_back(k);
      }
    }
    REQUIRE(order.size() == shapes.size());
    int64_t at = 0;
    double worst = 0;
    for (size_t k : order) {
      const int64_t n = numel_of(shapes[k].second);
      for (int64_t i = 0; i < n; ++i) {
        double applied = 0, grads = 0, magnitude = 0;
        for (int t = 0; t < kRounds; ++t) {
          applied += run.grads[static_cast<size_t>(t)][k][static_cast<size_t>(i)];
          const double g = grad_values(w, t, k, n)[static_cast<size_t>(i)];
          grads += g;
          magnitude += std::abs(g);
        }
        worst = std::max(worst, std::abs(applied + error[static_cast<size_t>(at + i)] - grads) / magnitude);
      }
      at += n;
    }
    MESSAGE("rank ", w, ": largest |sum(applied) + error - sum(gradients)| / sum|g| = ", worst);
    CHECK(worst <= 1e-14);
  }
}

TEST_CASE("PowerSGD: exact rounds before start_iter, then bytes on the wire by the closed form") {
  constexpr int kRounds = 4;
  const std::vector<RankRun> runs = run_ddp(2, 0, kRounds, {.rank = 1, .start_iter = 2});
  const std::vector<RankRun> plain = run_ddp(2, 0, 2, {.rank = 1, .start_iter = 100});
  // Rounds 0 and 1 are the all-reduce's, bitwise.
  for (int t = 0; t < 2; ++t) CHECK(runs[0].grads[static_cast<size_t>(t)] == plain[0].grads[static_cast<size_t>(t)]);
  // Compressed rounds send, per matrix [n, m] at rank r, (n + m) r elements instead of n m,
  // and the other tensors whole: w1 [16, 12] 28, kernel [6, 20] 26, w3 12, bias 16.
  const int64_t total = 16 * 12 + 16 + 4 * 3 + 6 * 4 * 5;
  const int64_t compressed = (16 + 12) + (6 + 20) + 12 + 16;
  for (int t = 0; t < kRounds; ++t) {
    CAPTURE(t);
    const CommHook::Traffic& tr = runs[0].traffic[static_cast<size_t>(t)];
    CHECK(tr.uncompressed == total);
    CHECK(tr.sent == (t < 2 ? total : compressed));
  }
  const double ratio = static_cast<double>(runs[0].round_bytes[3]) /
                       static_cast<double>(runs[0].round_bytes[0]);
  const double formula = static_cast<double>(compressed) / static_cast<double>(total);
  MESSAGE("bytes per round: exact ", runs[0].round_bytes[0], ", PowerSGD ", runs[0].round_bytes[3],
          " (ratio ", ratio, ", formula ", formula, ")");
  CHECK(std::abs(ratio - formula) <= 0.01 * formula);
}

TEST_CASE("PowerSGD resumes bitwise from its state dict (error feedback, Qs, rounds)") {
  // Without initial_q: the Qs are drawn from Philox keyed by the seed, the name and the round.
  const PowerSgdOptions o{.rank = 2, .start_iter = 1, .seed = 7};
  const std::vector<RankRun> whole = run_ddp(2, 0, 6, o);
  const std::vector<RankRun> head = run_ddp(2, 0, 3, o);
  std::vector<std::map<std::string, Tensor>> saved;
  for (const RankRun& r : head) saved.push_back(r.state);
  CHECK(saved[0].count("error.0") == 1);
  const std::vector<RankRun> tail = run_ddp(2, 3, 3, o, &saved);
  for (int w = 0; w < 2; ++w) {
    for (int t = 0; t < 3; ++t) {
      CHECK(tail[static_cast<size_t>(w)].grads[static_cast<size_t>(t)] ==
            whole[static_cast<size_t>(w)].grads[static_cast<size_t>(3 + t)]);
    }
  }
  // Without warm start each round draws new Qs, keyed by the round: rounds 2-3 from the state
  // after round 1 equal the uninterrupted run's.
  PowerSgdOptions cold = o;
  cold.warm_start = false;
  const std::vector<RankRun> cold_whole = run_ddp(2, 0, 4, cold);
  CHECK(cold_whole[0].grads[3] != whole[0].grads[3]);
  CHECK(cold_whole[0].state.count("q.0.0") + cold_whole[0].state.count("q.0.3") == 0);
  const std::vector<RankRun> cold_head = run_ddp(2, 0, 2, cold);
  std::vector<std::map<std::string, Tensor>> cold_saved;
  for (const RankRun& r : cold_head) cold_saved.push_back(r.state);
  const std::vector<RankRun> cold_tail = run_ddp(2, 2, 2, cold, &cold_saved);
  for (int t = 0; t < 2; ++t) CHECK(cold_tail[0].grads[static_cast<size_t>(t)] == cold_whole[0].grads[static_cast<size_t>(2 + t)]);
  // Another round counter draws other Qs: not the same. An older version's "rng" entry is
  // accepted and ignored.
  std::vector<std::map<std::string, Tensor>> other_round = cold_saved;
  for (auto& d : other_round) {
    d["rounds"] = Tensor::from_vector<int64_t>({3}, {});
    d["rng"] = Tensor::from_vector<int64_t>({7, 0}, {2});
  }
  const std::vector<RankRun> wrong = run_ddp(2, 2, 2, cold, &other_round);
  CHECK(wrong[0].grads[0] != cold_whole[0].grads[2]);
}

TEST_CASE("PowerSGD's drawn Qs do not depend on the bucket layout") {
  // One bucket, or buckets of 600 bytes (three): each matrix draws the same initial Q (keyed
  // by its name), so on 2 ranks (each sum a + b either way) the gradients are bitwise equal,
  // warm-started or drawn anew each round.
  int configs = 0;
  for (bool warm : {true, false}) {
    CAPTURE(warm);
    const PowerSgdOptions o{.rank = 2, .start_iter = 1, .warm_start = warm, .seed = 11};
    const std::vector<RankRun> one = run_ddp(2, 0, 4, o);
    const std::vector<RankRun> three = run_ddp(2, 0, 4, o, nullptr, 600);
    CHECK(three[0].places.at(three[0].bucket_names.at(0)).first == 0);
    int buckets = 0;
    for (const auto& [name, place] : three[0].places) buckets = std::max(buckets, place.first + 1);
    CHECK(buckets == 3);
    for (int w = 0; w < 2; ++w) CHECK(one[static_cast<size_t>(w)].grads == three[static_cast<size_t>(w)].grads);
    ++configs;
  }
  CHECK(configs == 2);
}

TEST_CASE("ZeRO 1-3 with a comm hook: every rank must reduce the same way") {
  // A rank with PowerSGD and one without would pair different collectives and hang: the
  // members' options (the hook's name among them) are compared at construction.
  int stages = 0;
  for (int stage : {1, 2, 3}) {
    CAPTURE(stage);
    std::vector<std::string> errors(2);
    run_threads(2, [&](CommPtr world) {
      Params model;
      std::shared_ptr<CommHook> hook;
      if (world->rank() == 0) hook = std::make_shared<PowerSgd>();
      errors[static_cast<size_t>(world->rank())] =
          error_of([&] { ZeroDataParallel z(model, *world, {.stage = stage, .comm_hook = hook}); });
    });
    for (const std::string& e : errors) CHECK(contains(e, "disagree on the parameter list (names, shapes, dtypes) or the options"));
    ++stages;
  }
  CHECK(stages == 3);
}

TEST_CASE("PowerSGD agrees with PyTorch's powerSGD_hook on the same gradients and initial Qs") {
  // tools/powersgd_peer.py: DDP on gloo with 2 processes, f64, rank 1 and 2, start_powerSGD_iter
  // 2, min_compression_rate 2, error feedback and warm start; the fixture's Q0 in place of
  // the hook's randn draw. Rounds 0-1 are the plain all-reduce, 2-5 compressed.
  const char* python = "/usr/bin/python3";
  const std::string script = "tools/powersgd_peer.py";  // runfiles-relative (data dep)
  REQUIRE_MESSAGE(std::filesystem::exists(script), "missing data dependency " << script);
  REQUIRE_MESSAGE(::access(python, X_OK) == 0,
                  python << " is missing; install Debian's python3-torch (tools/setup.sh does)");
  REQUIRE_MESSAGE(std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0,
                  python << " cannot import torch; install Debian's python3-torch "
                            "(tools/setup.sh does)");
  const char* tmp = std::getenv("TEST_TMPDIR");
  int configs = 0;
  for (int64_t rank : {1, 2}) {
    CAPTURE(rank);
    const std::string out = fmt::format("{}/powersgd_peer_{}.json", tmp ? tmp : "/tmp", rank);
    const std::string cmd =
        fmt::format("{} {} --ranks 2 --rank {} --rounds 6 --start 2 --out {} 2>&1", python, script,
                    rank, out);
    const int status = std::system(cmd.c_str());
    REQUIRE(WIFEXITED(status));
    REQUIRE_MESSAGE(WEXITSTATUS(status) == 0, "command failed: " << cmd);
    std::ifstream in(out);
    const nlohmann::json peer = nlohmann::json::parse(in);
    const std::vector<RankRun> runs =
        run_ddp(2, 0, 6, {.rank = rank, .start_iter = 2, .initial_q = q0_of});
    double worst = 0;
    REQUIRE(peer.at("grads").size() == 6);
    for (size_t t = 0; t < 6; ++t) {
      for (size_t k = 0; k < Params::shapes().size(); ++k) {
        const std::vector<double> theirs = peer.at("grads")[t][k].get<std::vector<double>>();
        const std::vector<double>& ours = runs[0].grads[t][k];
        REQUIRE(theirs.size() == ours.size());
        double scale = 1e-300;
        for (double x : theirs) scale = std::max(scale, std::abs(x));
        double w = 0;
        for (size_t i = 0; i < ours.size(); ++i) {
          w = std::max(w, std::abs(ours[i] - theirs[i]) / scale);
        }
        worst = std::max(worst, w);
      }
    }
    MESSAGE("rank ", rank, ": largest relative difference from PyTorch's hook ", worst);
    CHECK(worst <= 1e-12);
    ++configs;
  }
  CHECK(configs == 2);
}

TEST_CASE("PowerSGD: bad options and state dicts are errors naming the value") {
  CHECK(contains(error_of([] { PowerSgd hook({.rank = 0}); }), "PowerSgd: rank must be >= 1, got 0"));
  CHECK(contains(error_of([] { PowerSgd hook({.start_iter = -1}); }),
                 "PowerSgd: start_iter must be >= 0, got -1"));
  PowerSgd hook;
  CHECK(contains(error_of([&] { hook.load_state_dict({}); }), "PowerSgd: the state dict has no 'rounds'"));
  std::map<std::string, Tensor> dict = hook.state_dict();
  dict["bogus"] = zeros({2});
  CHECK(contains(error_of([&] { hook.load_state_dict(dict); }), "unexpected key 'bogus' [2]"));
  // Q0 of the wrong shape names the tensor and both shapes (the bucket holds the parameters
  // in reverse registration order: the kernel, [6, 20], first).
  const std::string err = error_of([] {
    run_ddp(2, 0, 1, {.start_iter = 0, .initial_q = [](int, int, const Shape&) { return zeros({3}); }});
  });
  CHECK(contains(err, "PowerSgd: initial_q for tensor 0 ('kernel') of bucket 0 must be [20, 1], got [3]"));
}

}  // namespace
}  // namespace tessera::parallel
