// 1-bit Adam (parallel/onebit_adam.h) with DDP on the threads backend: the warm-up is AdamW on
// the all-reduced gradients, bitwise; the compressed steps equal an independent f64 1-bit
// Adam on plain arrays (tests/parallel/onebit_reference.h for the reduction), sending the
// update or the momentum, with either scale; an element with no gradient (frozen v = 0) takes
// its chunk's step when the update is sent and an enormous one when the momentum is; a summing
// DDP gives the averaging run's steps; the bytes after the warm-up are the 1-bit all-reduce's;
// state dicts (the optimizer's, and each rank's error feedback in the hook) resume bitwise,
// and one saved with other settings is refused.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "parallel/data_parallel.h"
#include "parallel/onebit.h"
#include "parallel/onebit_adam.h"
#include "parallel/zero.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tests/parallel/onebit_reference.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_onebit;
using testing::contains;
using testing::error_of;

struct Params : nn::Module {
  explicit Params(DType dtype) : nn::Module("Params") {
    int k = 0;
    for (const Shape& shape : shapes()) {
      std::vector<double> v(static_cast<size_t>(numel_of(shape)));
      for (size_t i = 0; i < v.size(); ++i) v[i] = 0.1 * std::cos(0.3 * static_cast<double>(i) + k);
      register_parameter(fmt::format("p{}", k++), Tensor::from_vector<double>(v, shape).cast(dtype));
    }
  }
  static std::vector<Shape> shapes() { return {{12, 10}, {7}, {3, 5, 4}}; }
  Tensor forward(const Tensor& x) override { return x; }
};

// Rank r's gradient of parameter k at step t (0-based).
Vec grad_values(int r, int t, size_t k, int64_t n) {
  Vec v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] = std::sin(0.43 * static_cast<double>(i + 1) * static_cast<double>(k + 1) + 0.9 * r + 0.37 * t) + 0.05 * r;
  }
  return v;
}

constexpr double kLr = 0.01, kB1 = 0.9, kB2 = 0.99, kEps = 1e-8, kWd = 0.1;
// The largest |m| / sqrt(v) AdamW reaches with these betas: (1 - b1) / sqrt((1 - b2)
// (1 - b1^2 / b2)) = 2.345.
const double kBound = (1 - kB1) / std::sqrt((1 - kB2) * (1 - kB1 * kB1 / kB2));

// grad_values, with parameter 0's element 0 at 0 before the freeze and 1 after (wake).
Vec ref_grad(int r, int t, size_t k, int64_t n, bool wake, int64_t freeze) {
  Vec g = grad_values(r, t, k, n);
  if (wake && k == 0) g[0] = t < freeze ? 0.0 : 1.0;
  return g;
}

struct RankRun {
  std::vector<std::vector<Vec>> params;  // after each step, per parameter
  std::vector<std::vector<Vec>> grads;   // before each step (after DDP), per parameter
  std::vector<int64_t> bytes;            // gradient-kind bytes per step
  optim::Optimizer::StateDict opt_state;
  std::map<std::string, Tensor> hook_state;
};

struct Setup {
  int ranks = 2;
  DType dtype = DType::f64;
  bool onebit = true;  // else AdamW with a plain DDP
  int64_t freeze = 2;
  bool average = true;
  bool bias_correction = true;
  bool precondition = true;
  OnebitScale scale = OnebitScale::l1;
  bool dead_first = false;  // parameter 0's element 0 gets no gradient on any rank
  bool wake_first = false;  // ... until the freeze, then a gradient of 1 on every rank
  bool bound_update = true;
};

// Steps [first, first + steps) on `s.ranks` threads; `load`: per rank (optimizer, hook) state.
std::vector<RankRun> run(const Setup& s, int first, int steps,
                         const std::vector<RankRun>* load = nullptr) {
  std::vector<RankRun> out(static_cast<size_t>(s.ranks));
  run_threads(s.ranks, [&](CommPtr world) {
    RankRun& me = out[static_cast<size_t>(world->rank())];
    Params model(s.dtype);
    const nn::NamedTensors named = model.named_parameters();
    std::vector<Tensor> params;
    for (const auto& e : named) params.push_back(e.second);
    std::unique_ptr<optim::Optimizer> opt;
    std::shared_ptr<CommHook> hook;
    if (s.onebit) {
      auto o = std::make_unique<OnebitAdam>(
          std::vector<optim::ParamGroup>{{params, {}}}, *world,
          OnebitAdamOptions{.lr = kLr, .betas = {kB1, kB2}, .eps = kEps, .weight_decay = kWd,
                            .freeze_step = s.freeze, .bias_correction = s.bias_correction,
                            .precondition = s.precondition, .scale = s.scale,
                            .bound_update = s.bound_update});
      hook = o->comm_hook();
      opt = std::move(o);
    } else {
      opt = std::make_unique<optim::AdamW>(
          params, optim::AdamWOptions{.lr = kLr, .betas = {kB1, kB2}, .eps = kEps, .weight_decay = kWd});
    }
    DistributedDataParallel ddp(model, *world, {.average = s.average, .comm_hook = hook});
    if (load) {
      const RankRun& from = (*load)[static_cast<size_t>(world->rank())];
      // The parameters as they were, then the states.
      NoGradGuard no_grad;
      for (size_t k = 0; k < params.size(); ++k) {
        params[k].copy_(Tensor::from_vector<double>(from.params.back()[k], params[k].shape()).cast(s.dtype));
      }
      opt->load_state_dict(from.opt_state);
      hook->load_state_dict(from.hook_state);
    }
    for (int t = first; t < first + steps; ++t) {
      for (size_t k = 0; k < params.size(); ++k) {
        Vec g = grad_values(world->rank(), t, k, params[k].numel());
        if (s.dead_first && k == 0) g[0] = 0.0;
        if (s.wake_first && k == 0) g[0] = t < s.freeze ? 0.0 : 1.0;
        if (!s.average) {
          for (double& x : g) x /= s.ranks;  // each rank's share of the mean, summed
        }
        params[k].set_grad(Tensor::from_vector<double>(g, params[k].shape()).cast(s.dtype));
      }
      CommLog log;
      {
        CommLogScope scope(log);
        ddp.finish();
        std::vector<Vec> reduced;
        for (const Tensor& p : params) reduced.push_back(p.grad().cast(DType::f64).to_vector<double>());
        me.grads.push_back(reduced);
        opt->step();
      }
      me.bytes.push_back(log.bytes({CommKind::gradients}));
      std::vector<Vec> now;
      for (const Tensor& p : params) now.push_back(p.cast(DType::f64).to_vector<double>());
      me.params.push_back(now);
    }
    me.opt_state = opt->state_dict();
    if (hook) me.hook_state = hook->state_dict();
  });
  return out;
}

TEST_CASE("1-bit Adam's warm-up is AdamW on the all-reduced gradients, bitwise") {
  for (DType dtype : {DType::f32, DType::f64}) {
    CAPTURE(dtype);
    const Setup onebit{.ranks = 2, .dtype = dtype, .freeze = 3};
    Setup adamw = onebit;
    adamw.onebit = false;
    const std::vector<RankRun> a = run(onebit, 0, 3), b = run(adamw, 0, 3);
    for (int t = 0; t < 3; ++t) CHECK(a[0].params[static_cast<size_t>(t)] == b[0].params[static_cast<size_t>(t)]);
  }
}

TEST_CASE("1-bit Adam after the warm-up equals an independent f64 1-bit Adam") {
  // Freeze after step 2; steps 3-6 compress each parameter's momentum (padded to 8 x ranks).
  constexpr int kSteps = 6;
  int configs = 0;
  for (bool wake : {false, true}) {
  for (bool precondition : {true, false}) {
  for (OnebitScale scale : {OnebitScale::l1, OnebitScale::l2}) {
  for (int w : {2, 4}) {
    for (bool bias_correction : {true, false}) {
      CAPTURE(wake);
      CAPTURE(precondition);
      CAPTURE(onebit_scale_name(scale));
      CAPTURE(w);
      CAPTURE(bias_correction);
      const Setup s{.ranks = w, .freeze = 2, .bias_correction = bias_correction,
                    .precondition = precondition, .scale = scale, .wake_first = wake};
      const std::vector<RankRun> got = run(s, 0, kSteps);
      // The reference: every rank's parameters, m and v (the same on every rank), errors.
      Params init(DType::f64);
      std::vector<Vec> p, m, v;
      for (const auto& e : init.named_parameters()) {
        p.push_back(e.second.to_vector<double>());
        m.emplace_back(p.back().size(), 0.0);
        v.emplace_back(p.back().size(), 0.0);
      }
      std::vector<RefState> err;
      for (const Vec& x : p) err.push_back(fresh_state(w, onebit_padded(static_cast<int64_t>(x.size()), w)));
      double worst = 0, worst_scale = 0;  // the largest difference, and |parameter|
      for (int t = 0; t < kSteps; ++t) {
        const double step = t + 1;
        for (size_t k = 0; k < p.size(); ++k) {
          const int64_t n = static_cast<int64_t>(p[k].size());
          const double frozen = std::min<double>(step, static_cast<double>(s.freeze));
          const double bc1 = bias_correction ? 1 - std::pow(kB1, step) : 1.0;
          const double bc2 = bias_correction ? 1 - std::pow(kB2, frozen) : 1.0;
          const auto denom = [&](size_t j) { return std::sqrt(v[k][j]) / std::sqrt(bc2) + kEps; };
          if (step <= s.freeze) {
            Vec g(static_cast<size_t>(n), 0.0);
            for (int r = 0; r < w; ++r) {
              const Vec gr = ref_grad(r, t, k, n, wake, s.freeze);
              for (int64_t i = 0; i < n; ++i) g[static_cast<size_t>(i)] += gr[static_cast<size_t>(i)];
            }
            for (double& x : g) x /= w;
            for (int64_t i = 0; i < n; ++i) {
              const size_t j = static_cast<size_t>(i);
              m[k][j] += (1 - kB1) * (g[j] - m[k][j]);
              v[k][j] = v[k][j] * kB2 + (1 - kB2) * g[j] * g[j];
            }
          } else {
            const int64_t padded = onebit_padded(n, w);
            std::vector<Vec> x;
            for (int r = 0; r < w; ++r) {
              const Vec gr = ref_grad(r, t, k, n, wake, s.freeze);
              Vec mr(static_cast<size_t>(padded), 0.0);
              for (int64_t i = 0; i < n; ++i) {
                const size_t j = static_cast<size_t>(i);
                mr[j] = m[k][j] + (1 - kB1) * (gr[j] - m[k][j]);
                if (precondition) {  // the update m / d is sent, within AdamW's bound
                  mr[j] = std::clamp(mr[j] / denom(j), -kBound * std::sqrt(bc2), kBound * std::sqrt(bc2));
                }
              }
              x.push_back(mr);
            }
            const Vec mean = reference(x, err[k], w, scale == OnebitScale::l2);
            for (int64_t i = 0; i < n; ++i) {
              const size_t j = static_cast<size_t>(i);
              m[k][j] = precondition ? mean[j] * denom(j) : mean[j];
            }
          }
          for (int64_t i = 0; i < n; ++i) {
            const size_t j = static_cast<size_t>(i);
            p[k][j] = p[k][j] * (1 - kLr * kWd) - (kLr / bc1) * (m[k][j] / (std::sqrt(v[k][j]) / std::sqrt(bc2) + kEps));
          }
          for (int r = 0; r < w; ++r) {
            const Vec& have = got[static_cast<size_t>(r)].params[static_cast<size_t>(t)][k];
            for (int64_t i = 0; i < n; ++i) {
              worst = std::max(worst, std::abs(have[static_cast<size_t>(i)] - p[k][static_cast<size_t>(i)]));
              worst_scale = std::max(worst_scale, std::abs(p[k][static_cast<size_t>(i)]));
            }
          }
        }
      }
      MESSAGE(std::string(wake ? "wake, " : ""), std::string(precondition ? "update" : "momentum"), ", ",
              std::string(onebit_scale_name(scale)), ", ", w, " ranks, bias correction ", bias_correction,
              ": largest parameter difference ", worst);
      CHECK(worst <= 1e-13 * std::max(1.0, worst_scale));
      ++configs;
    }
  }
  }
  }
  }
  CHECK(configs == 32);
}

TEST_CASE("1-bit Adam: an element with no gradient (frozen v = 0) takes its chunk's step when the update is sent") {
  // Sending m, the element's decompressed momentum is the chunk's sign scale and its step
  // lr x scale / eps (eps 1e-8): the failure that makes the paper's 1-bit Adam diverge on a
  // GPT whose rare bytes' embedding rows see almost no gradient. Sending u = m / d, every
  // element of a server chunk moves by the same lr x t / bc1.
  for (bool precondition : {true, false}) {
    CAPTURE(precondition);
    const Setup s{.ranks = 2, .freeze = 2, .precondition = precondition, .dead_first = true};
    const std::vector<RankRun> got = run(s, 0, 3);
    // Step 3 (the first compressed one), less the weight decay (parameter 0 is 12 x 10).
    const auto step_of = [&](size_t i) {
      const double before = got[0].params[1][0][i], after = got[0].params[2][0][i];
      return std::abs(after - before * (1 - kLr * kWd));
    };
    MESSAGE(std::string(precondition ? "update" : "momentum"), ": the dead element's step ", step_of(0),
            ", its neighbour's ", step_of(1), " (lr ", kLr, ")");
    if (precondition) {
      CHECK(std::abs(step_of(0) - step_of(1)) <= 1e-15);
      CHECK(step_of(0) < 10 * kLr);  // AdamW's steps here reach lr / bc1 = 3.7 lr
    } else {
      CHECK(step_of(0) > 1e4 * kLr);
    }
  }
}

TEST_CASE("1-bit Adam: a gradient that appears after the freeze is sent within Adam's step bound") {
  // Parameter 0's element 0 has no gradient through the warm-up (v = 0) and 1 afterwards:
  // unbounded it sends (1 - beta1) / eps = 1e7 and sets its chunk's l1 scale, so every
  // element of the chunk moves by ~1e5 lr; bounded (the default) it sends at most
  // kBound sqrt(bc2), and no element moves by more than lr / bc1 times that.
  for (bool bound : {true, false}) {
    CAPTURE(bound);
    const Setup s{.ranks = 2, .freeze = 2, .wake_first = true, .bound_update = bound};
    const std::vector<RankRun> got = run(s, 0, 3);
    double most = 0;  // the largest step of step 3 (the first compressed one), less the decay
    for (size_t k = 0; k < got[0].params[2].size(); ++k) {
      for (size_t i = 0; i < got[0].params[2][k].size(); ++i) {
        const double before = got[0].params[1][k][i];
        most = std::max(most, std::abs(got[0].params[2][k][i] - before * (1 - kLr * kWd)));
      }
    }
    MESSAGE(std::string(bound ? "bounded" : "unbounded"), ": the largest step ", most, " (lr ", kLr, ")");
    if (bound) {
      // Every sent element within kBound sqrt(bc2), so each scale and step within lr / bc1 of it.
      const double bc1 = 1 - std::pow(kB1, 3), bc2 = 1 - std::pow(kB2, 2);
      CHECK(most <= kLr / bc1 * kBound * std::sqrt(bc2) * (1 + 1e-12));
    } else {
      CHECK(most > 1e4 * kLr);
    }
  }
}

TEST_CASE("1-bit Adam under a summing DDP (each rank a share of the mean) takes the averaging run's steps") {
  // The shares are the gradients over 2 or 4 (exact in f64), so the steps are bitwise equal.
  // The gradients the step (and a clip before it) sees are too: the mean during the
  // warm-up, then each rank's own gradient on the mean's scale (the hook scales a share by
  // the group size), rank 1's own values.
  for (int w : {2, 4}) {
    CAPTURE(w);
    const Setup avg{.ranks = w, .freeze = 2};
    Setup sum = avg;
    sum.average = false;
    const std::vector<RankRun> a = run(avg, 0, 5), b = run(sum, 0, 5);
    for (int t = 0; t < 5; ++t) {
      CAPTURE(t);
      const size_t st = static_cast<size_t>(t);
      CHECK(a[1].params[st] == b[1].params[st]);
      CHECK(a[1].grads[st] == b[1].grads[st]);
      if (t >= 2) {
        for (size_t k = 0; k < b[1].grads[st].size(); ++k) {
          CHECK(b[1].grads[st][k] ==
                grad_values(1, t, k, static_cast<int64_t>(b[1].grads[st][k].size())));
        }
      }
    }
  }
}

TEST_CASE("1-bit Adam under ZeRO 0: each rank clips by its own norm; an inf/NaN norm on one rank is every rank's") {
  // After the warm-up each rank keeps its own gradient. A rank whose gradient is not finite
  // must not be the only one to skip the step (the others would wait for it in the 1-bit
  // all-reduce): ZeroDataParallel::clip_grad_norm agrees on non-finite norms over the group.
  for (bool nan_on_rank1 : {false, true}) {
    CAPTURE(nan_on_rank1);
    std::vector<double> norms(2), own(2);
    run_threads(2, [&](CommPtr world) {
      Params model(DType::f64);
      auto hook = std::make_shared<OnebitAdamHook>();
      ZeroDataParallel zero(model, *world, {.stage = 0, .comm_hook = hook});
      OnebitAdam opt(zero.param_groups(kLr, kWd), *world,
                     OnebitAdamOptions{.lr = kLr, .freeze_step = 1}, hook);
      const nn::NamedTensors named = model.named_parameters();
      for (int t = 0; t < 2; ++t) {
        zero.zero_grad();
        size_t k = 0;
        for (const auto& [name, p] : named) {
          Vec g = grad_values(world->rank(), t, k++, p.numel());
          if (t == 1 && nan_on_rank1 && world->rank() == 1) g[0] = std::nan("");
          p.set_grad(Tensor::from_vector<double>(g, p.shape()));
        }
        zero.finish();
        if (t == 0) {  // the warm-up step: the mean, the same norm everywhere
          zero.clip_grad_norm(1e9);
          opt.step();
          continue;
        }
        double sq = 0;  // this rank's own norm, from its own values
        k = 0;
        for (const auto& [name, p] : named) {
          for (double v : grad_values(world->rank(), t, k++, p.numel())) sq += v * v;
        }
        own[static_cast<size_t>(world->rank())] = std::sqrt(sq);
        norms[static_cast<size_t>(world->rank())] = zero.clip_grad_norm(1e9);
      }
    });
    if (!nan_on_rank1) {
      for (size_t r = 0; r < 2; ++r) CHECK(std::abs(norms[r] - own[r]) <= 1e-12 * own[r]);
      CHECK(norms[0] != norms[1]);
    } else {
      CHECK(std::isinf(norms[0]));  // rank 0's own norm is finite, but rank 1's is not
      CHECK(std::isnan(norms[1]));
    }
  }
}

TEST_CASE("1-bit Adam: after the warm-up each step sends the 1-bit all-reduce's bytes") {
  const Setup s{.ranks = 4, .dtype = DType::f32, .freeze = 2};
  const std::vector<RankRun> got = run(s, 0, 4);
  int64_t onebit = 0, exact = 0;
  for (const Shape& shape : Params::shapes()) {
    const int64_t padded = onebit_padded(numel_of(shape), 4);
    onebit += padded / 4 * 3 / 4 + 8 * 3;  // onebit.h: n/4 (W-1)/W + 8 (W-1)
    exact += numel_of(shape);
  }
  // The warm-up's one bucket all-reduce: 2 (W - 1) / W x 4 bytes an element.
  CHECK(got[0].bytes[0] == exact * 4 * 2 * 3 / 4);
  CHECK(got[0].bytes[2] == onebit);
  CHECK(got[0].bytes[3] == onebit);
  MESSAGE("bytes per step: warm-up ", got[0].bytes[0], ", compressed ", got[0].bytes[2]);
}

TEST_CASE("1-bit Adam resumes bitwise from its state dicts (the optimizer's, and each rank's errors)") {
  const Setup s{.ranks = 2, .freeze = 2};
  const std::vector<RankRun> whole = run(s, 0, 6);
  const std::vector<RankRun> head = run(s, 0, 4);
  CHECK(head[0].hook_state.count("worker.0") == 1);
  CHECK(head[0].hook_state.at("worker.0").to_vector<double>() !=
        head[1].hook_state.at("worker.0").to_vector<double>());  // per rank
  const std::vector<RankRun> tail = run(s, 4, 2, &head);
  for (int r = 0; r < 2; ++r) {
    for (int t = 0; t < 2; ++t) {
      CHECK(tail[static_cast<size_t>(r)].params[static_cast<size_t>(t)] ==
            whole[static_cast<size_t>(r)].params[static_cast<size_t>(4 + t)]);
    }
  }
}

TEST_CASE("1-bit Adam: bad options and states are errors naming the value") {
  run_threads(1, [&](CommPtr world) {
    const Tensor p = zeros({4});
    CHECK(contains(error_of([&] { OnebitAdam opt({{{p}, {}}}, *world, {.freeze_step = 0}); }),
                   "OnebitAdam: freeze_step must be >= 1"));
    OnebitAdam opt({{{p}, {}}}, *world, {});
    CHECK(contains(error_of([&] { opt.comm_hook()->load_state_dict({{"bogus", zeros({2})}}); }),
                   "unexpected key 'bogus' [2]"));
    const Tensor h = zeros({4}, DType::bf16);
    h.set_grad(zeros({4}, DType::bf16));
    OnebitAdam half({{{h}, {}}}, *world, {});
    CHECK(contains(error_of([&] { half.step(); }), "parameters must be f32 or f64"));
    // ZeRO 1-3 take their block of each reduced segment; this hook leaves each rank its own
    // gradient after the warm-up, so they refuse it.
    Params model(DType::f32);
    CHECK(contains(error_of([&] { ZeroDataParallel z(model, *world, {.stage = 1, .comm_hook = opt.comm_hook()}); }),
                   "comm hook 'onebit_adam' leaves each rank its own gradient, and stage 1 needs "
                   "every segment reduced"));
    // A state dict saved with other settings (here the scale) is refused, naming both.
    const Tensor q = zeros({4});
    OnebitAdam other({{{q}, {}}}, *world, {.scale = OnebitScale::l2});
    CHECK(contains(error_of([&] { other.load_state_dict(opt.state_dict()); }),
                   "OnebitAdam: the state dict was saved with freeze_step 100, bias_correction "
                   "true, and sends the update with l1 scales, bounded; this optimizer has "
                   "freeze_step 100, bias_correction true, and sends the update with l2 scales, "
                   "bounded (gpt, mnist: --onebit_freeze, --onebit_send, --onebit_scale, "
                   "--onebit_bound)"));
    // The bound only matters when the update is sent: the momentum resumes either way.
    const Tensor r = zeros({4});
    OnebitAdam paper({{{r}, {}}}, *world, {.precondition = false, .scale = OnebitScale::l2});
    OnebitAdam paper_unbounded({{{zeros({4})}, {}}}, *world,
                               {.precondition = false, .scale = OnebitScale::l2, .bound_update = false});
    paper_unbounded.load_state_dict(paper.state_dict());
    // A dict from before precondition, scale and bound_update existed stands for the paper's.
    optim::Optimizer::StateDict older = paper.state_dict();
    for (const char* key : {"hparam.precondition", "hparam.scale_l2", "hparam.bound_update"}) {
      CHECK(older.erase(key) == 1);
    }
    paper_unbounded.load_state_dict(older);
    CHECK(contains(error_of([&] { opt.load_state_dict(older); }),
                   "was saved with freeze_step 100, bias_correction true, and sends the momentum "
                   "with l2 scales; this optimizer has"));
  });
}

}  // namespace
}  // namespace tessera::parallel
