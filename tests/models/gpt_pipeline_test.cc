// GPT on a pipeline (models/gpt/pipeline.h): partitions balanced by parameter count or given;
// one training step of GPT-mini (f64) with GPipe, 1F1B and interleaved 1F1B on 2, 3 and 6
// ranks (with and without recomputation) gives the single-device loss and every gradient
// (1e-12), the tied embedding's included; 10 AdamW steps on every pp x dp factorisation of
// 4 and 8 ranks, each schedule, ZeRO 0 and 1 over dp, give the single-device losses and
// parameters (1e-10); errors for impossible splits.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>
#include <set>
#include <string>

#include "models/data/text.h"
#include "models/gpt/pipeline.h"
#include "optim/adamw.h"
#include "parallel/mesh.h"
#include "parallel/zero.h"
#include "parallel/comm/threads.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::gpt {
namespace {

using namespace parallel::pipeline;
using testing::contains;
using testing::error_of;

constexpr int64_t kBatch = 12, kContext = 16;  // 12 rows: 3, 4 or 6 micro-batches

std::shared_ptr<Gpt> make_gpt(int layers) {
  manual_seed(0);
  auto m = std::make_shared<Gpt>(
      GptConfig{.layers = layers, .heads = 2, .width = 16, .context = kContext, .vocab = 256});
  m->to(DType::f64);
  return m;
}

const data::TextWindows& windows() {
  static const data::TextWindows w = [] {
    std::vector<uint8_t> bytes;
    for (int i = 0; i < 4096; ++i) bytes.push_back(static_cast<uint8_t>("pipeline stages "[i % 16]));
    return data::TextWindows(std::move(bytes), data::TextSplit::train, 2);
  }();
  return w;
}

TEST_CASE("partitions: balanced by parameter count, or given") {
  const auto model = make_gpt(4);
  // embed 256*16 + 16*16 = 4352, each block 12*16*16 + 13*16 = 3280, head 32.
  CHECK(partition_gpt(*model, 2).str() == "stage 0: embed h.0 | stage 1: h.1 h.2 h.3 head");
  CHECK(partition_gpt(*model, 3).str() == "stage 0: embed | stage 1: h.0 h.1 | stage 2: h.2 h.3 head");
  CHECK(partition_gpt(*model, 6).str() ==
        "stage 0: embed | stage 1: h.0 | stage 2: h.1 | stage 3: h.2 | stage 4: h.3 | stage 5: head");
  CHECK(partition_gpt(*model, 2, {3, 3}).str() == "stage 0: embed h.0 h.1 | stage 1: h.2 h.3 head");
  CHECK(contains(error_of([&] { partition_gpt(*model, 7); }),
                 "a GPT of 4 blocks has 6 pipeline layers (embed, the blocks, head): pipeline "
                 "partition: 7 stages for 6 layers"));
  CHECK(contains(error_of([&] { partition_gpt(*model, 2, {3, 2}); }),
                 "the stages hold 5 layers, the model has 6"));
}

void check_step(const Schedule& schedule, bool recompute) {
  constexpr int kLayers = 4;
  const int m = schedule.microbatches;
  const data::TextBatch whole = windows().get(0, kBatch, kContext);
  const auto ref = make_gpt(kLayers);
  const Tensor ref_loss = Gpt::loss((*ref)(whole.idx), whole.targets);
  ref_loss.backward();
  std::map<std::string, Tensor> want;
  for (const auto& [name, t] : ref->named_parameters()) want[name] = t.grad();

  parallel::run_threads(schedule.ranks, [&](parallel::CommPtr pp) {
    const auto model = make_gpt(kLayers);
    const GptPipeline pipe = partition_gpt(*model, schedule.num_stages());
    const PipelineStep step = run_pipeline(
        *pp, schedule, pipe.chunks(*model, schedule, pp->rank()),
        [&](int mb) { return windows().get(0, kBatch, kContext, mb, m).idx; },
        [&](const Tensor& logits, int mb) {
          return Gpt::loss(logits, windows().get(0, kBatch, kContext, mb, m).targets);
        },
        {.recompute = recompute});
    pipe.sync_tied_gradients(*model, *pp, schedule);
    CHECK(std::abs(step.loss - ref_loss.item<double>()) <= 1e-12);
    const nn::NamedTensors mine = pipe.parameters(*model, schedule, pp->rank());
    CHECK(!mine.empty());
    // Plain variables, not a structured binding: CAPTURE captures them (clang < 16 rejects
    // that).
    for (const auto& entry : mine) {
      const std::string& name = entry.first;
      const Tensor& t = entry.second;
      CAPTURE(name);
      REQUIRE(t.grad().defined());
      CHECK(max(abs(t.grad() - want.at(name))).item<double>() <= 1e-12);
    }
  });
}

TEST_CASE("one step on every schedule equals one device, the tied embedding included") {
  for (bool recompute : {false, true}) {
    CAPTURE(recompute);
    for (int p : {2, 3}) {
      CAPTURE(p);
      check_step(gpipe(p, 4), recompute);
      check_step(one_f_one_b(p, 4), recompute);
    }
    check_step(one_f_one_b(6, 4), recompute);          // one pipeline layer per stage
    check_step(interleaved_1f1b(2, 4, 2), recompute);  // 4 stages on 2 ranks
    check_step(interleaved_1f1b(3, 3, 2), recompute);  // 6 stages on 3 ranks
  }
}

// ---- pipeline x data parallel (ZeRO 0 and 1), 10 AdamW steps -----------------------------

constexpr int kSteps = 10, kMicro = 4, kBlocks = 6;  // 8 pipeline layers: up to 8 stages
constexpr int64_t kGlobalBatch = 32;                  // 4 micro-batches x up to 8 dp ranks
constexpr double kLr = 1e-2, kWd = 0.1;

std::vector<double> train_reference(std::map<std::string, std::vector<double>>* params) {
  const auto model = make_gpt(kBlocks);
  optim::AdamW opt(optim::decay_groups(model->named_parameters(), kLr, kWd),
                   {.lr = kLr, .weight_decay = kWd});
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    const data::TextBatch b = windows().get(step, kGlobalBatch, kContext);
    Tensor loss = Gpt::loss((*model)(b.idx), b.targets);
    losses.push_back(loss.item<double>());
    loss.backward();
    opt.step();
  }
  for (const auto& [name, t] : model->named_parameters()) (*params)[name] = t.to_vector<double>();
  return losses;
}

struct PpDpRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> params;  // this rank's stages' parameters
};

PpDpRun train_pp_dp(parallel::CommPtr world, int pp, int dp, const std::string& schedule_name,
                    int chunks, int zero_stage) {
  parallel::DeviceMesh mesh(world, {{"pp", pp}, {"dp", dp}});
  parallel::Communicator& ppg = mesh.group("pp");
  parallel::Communicator& dpg = mesh.group("dp");
  const auto model = make_gpt(kBlocks);
  const Schedule schedule = make_schedule(schedule_name, pp, kMicro, chunks);
  const GptPipeline pipe = partition_gpt(*model, schedule.num_stages());
  const auto stage = pipe.stage_module(*model, schedule, ppg.rank());
  parallel::ZeroDataParallel zero(*stage, dpg, {.stage = zero_stage});
  optim::AdamW opt(zero.param_groups(kLr, kWd), {.lr = kLr, .weight_decay = kWd});
  const int parts = dp * kMicro;
  PpDpRun run;
  for (int step = 0; step < kSteps; ++step) {
    zero.zero_grad();
    PipelineStep r;
    {
      // Gradients accumulate over the micro-batches; the dp reduction runs once, below.
      auto guard = zero.no_sync();
      auto batch = [&](int mb) {
        return windows().get(step, kGlobalBatch, kContext, dpg.rank() * kMicro + mb, parts);
      };
      r = run_pipeline(ppg, schedule, pipe.chunks(*model, schedule, ppg.rank()),
                       [&](int mb) { return batch(mb).idx; },
                       [&](const Tensor& logits, int mb) {
                         return Gpt::loss(logits, batch(mb).targets);
                       });
      pipe.sync_tied_gradients(*model, ppg, schedule);
    }
    zero.finish();
    zero.step(opt);
    Tensor loss = Tensor::from_vector<double>({r.loss}, {1});
    dpg.all_reduce(loss, parallel::ReduceOp::avg);
    run.losses.push_back(loss.item<double>());
  }
  for (const auto& [name, t] : zero.model_state_dict()) run.params[name] = t.to_vector<double>();
  return run;
}

TEST_CASE("pipeline x data parallel: every factorisation, schedule and ZeRO 0/1 equals one device") {
  std::map<std::string, std::vector<double>> want;
  const std::vector<double> ref = train_reference(&want);
  CHECK(ref.back() < ref.front() - 0.5);  // it learns
  int runs = 0;
  for (int world : {4, 8}) {
    for (int pp = 1; pp <= world; pp *= 2) {
      const int dp = world / pp;
      for (const char* name : {"gpipe", "1f1b", "interleaved"}) {
        const int chunks = std::string(name) == "interleaved" ? 2 : 1;
        if (pp == 1 && std::string(name) != "1f1b") continue;  // one stage: all schedules alike
        if (pp * chunks > kBlocks + 2) {
          MESSAGE(fmt::format("skipped: {} with pp={} needs {} stages, the model has {} "
                              "pipeline layers", name, pp, pp * chunks, kBlocks + 2));
          continue;
        }
        for (int zero : {0, 1}) {
          CAPTURE(world);
          CAPTURE(pp);
          CAPTURE(dp);
          CAPTURE(name);
          CAPTURE(zero);
          std::vector<PpDpRun> got(world);
          parallel::run_threads(world, [&](parallel::CommPtr w) {
            got[w->rank()] = train_pp_dp(w, pp, dp, name, chunks, zero);
          });
          double loss_err = 0, param_err = 0;
          std::set<std::string> covered;
          for (const PpDpRun& r : got) {
            REQUIRE(r.losses.size() == ref.size());
            for (size_t i = 0; i < ref.size(); ++i) {
              loss_err = std::max(loss_err, std::abs(r.losses[i] - ref[i]));
            }
            for (const auto& [pname, v] : r.params) {
              covered.insert(pname);
              const std::vector<double>& w = want.at(pname);
              REQUIRE(v.size() == w.size());
              for (size_t i = 0; i < v.size(); ++i) param_err = std::max(param_err, std::abs(v[i] - w[i]));
            }
          }
          MESSAGE(fmt::format("pp={} dp={} {} zero={}: loss err {:.2g}, param err {:.2g}", pp,
                              dp, name, zero, loss_err, param_err));
          CHECK(covered.size() == want.size());  // every parameter lives on some rank
          CHECK(loss_err <= 1e-10);
          CHECK(param_err <= 1e-10);
          ++runs;
        }
      }
    }
  }
  // 4 ranks: pp 1 (1F1B only) 1 + pp 2 and pp 4 (3 schedules each) 6 = 7 layouts; 8 ranks:
  // 1 + 3 + 3 + pp 8 (GPipe, 1F1B; interleaved needs 16 stages of 8 layers: skipped) 2 = 9.
  // 16 layouts x ZeRO 0/1 = 32 runs.
  CHECK(runs == 32);
}

}  // namespace
}  // namespace tessera::gpt
