// GPT on a pipeline (models/gpt/pipeline.h): partitions balanced by parameter count or given,
// and one training step of GPT-mini (f64) with GPipe, 1F1B and interleaved 1F1B on 2 and 4
// ranks (with and without recomputation) gives the single-device loss and every gradient
// (1e-12), the tied embedding's included; errors for impossible splits.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>
#include <string>

#include "models/data/text.h"
#include "models/gpt/pipeline.h"
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
    for (const auto& [name, t] : mine) {
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

}  // namespace
}  // namespace tessera::gpt
