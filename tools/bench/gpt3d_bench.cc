// GPT-mini on 8 simulated ranks (threads backend) under every pp x dp x tp factorisation,
// pipeline schedule and ZeRO 0/1: bytes each rank sends per training step by mesh axis (from
// the comm log, the second step) and the peak memory per rank (allocator trackers, the
// second step, activations included), as a markdown table.
//
//   bazel run //tools/bench:gpt3d_bench -- --layers=6 --width=64 --context=32 --batch=64
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "models/common/flags.h"
#include "models/data/text.h"
#include "models/gpt/parallel3d.h"
#include "parallel/comm/comm_log.h"
#include "parallel/comm/threads.h"
#include "tensor/allocator.h"
#include "tensor/random.h"

using namespace tessera;

int main(int argc, char** argv) {
  int64_t layers = 6, width = 64, heads = 8, context = 32, batch = 64, micro = 8, ranks = 8;
  models::Flags flags("gpt3d_bench", "Bytes per axis and peak memory per rank of 3-D GPT runs.");
  flags.bind("layers", layers, "transformer blocks");
  flags.bind("width", width, "embedding width");
  flags.bind("heads", heads, "attention heads");
  flags.bind("context", context, "sequence length");
  flags.bind("batch", batch, "global batch (rows)");
  flags.bind("microbatches", micro, "micro-batches per dp rank");
  flags.bind("ranks", ranks, "simulated ranks");
  bool sp = false;
  flags.bind("sp", sp, "sequence parallelism where tp > 1");
  try {
    flags.parse(argc, argv);
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  const data::TextCorpus corpus = data::load_text(data::kFortunesDir);
  const data::TextWindows windows(corpus, data::TextSplit::train, 0);
  const gpt::GptConfig config{.layers = layers, .heads = heads, .width = width,
                              .context = context, .vocab = 256};
  fmt::print("GPT {} layers, width {}, {} heads, context {}, batch {}, {} micro-batches per dp "
             "rank, f32, {} ranks ({} parameters){}\n\n",
             layers, width, heads, context, batch, micro, ranks, config.num_parameters(),
             sp ? ", sequence parallel where tp > 1" : "");
  fmt::print("| pp | dp | tp | schedule | ZeRO | sent per step, pp | dp | tp | embedding | "
             "peak memory per rank (max) | (min) |\n");
  fmt::print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
  auto kib = [](double b) { return fmt::format("{:.1f} KiB", b / 1024); };
  auto mib = [](double b) { return fmt::format("{:.2f} MiB", b / (1 << 20)); };
  for (int64_t pp = 1; pp <= ranks; pp *= 2) {
    for (int64_t dp = 1; pp * dp <= ranks; dp *= 2) {
      const int64_t tp = ranks / (pp * dp);
      if (heads % tp != 0) continue;
      for (const char* name : {"gpipe", "1f1b", "interleaved"}) {
        const int64_t chunks = std::string(name) == "interleaved" ? 2 : 1;
        if (pp == 1 && std::string(name) != "1f1b") continue;
        if (pp * chunks > layers + 2 || (chunks > 1 && micro % pp != 0)) continue;
        for (int64_t zero : {0, 1}) {
          std::vector<std::map<std::string, int64_t>> bytes(ranks);
          std::vector<int64_t> peak(ranks);
          parallel::run_threads(static_cast<int>(ranks), [&](parallel::CommPtr world) {
            MemoryTracker tracker;
            MemoryScope scope(&tracker);
            manual_seed(0);
            gpt::Gpt model(config);
            gpt::Gpt3d g(model, world, {.pp = pp, .dp = dp, .tp = tp, .zero = zero,
                                        .schedule = name, .chunks = chunks, .microbatches = micro,
                                        .sequence_parallel = sp && tp > 1});
            data::TextBatch b = windows.get(0, batch, context);
            g.train_step(b.idx, b.targets, 1e-3);  // the first step creates optimizer state
            b = windows.get(1, batch, context);
            tracker.reset_peak();
            parallel::CommLog log;
            {
              parallel::CommLogScope log_scope(log);
              g.train_step(b.idx, b.targets, 1e-3);
            }
            for (const parallel::CommRecord& r : log.records) bytes[world->rank()][r.group] += r.bytes;
            peak[world->rank()] = tracker.peak();
          });
          // The busiest rank per axis.
          auto most = [&](const std::string& axis) {
            int64_t m = 0;
            for (auto& per : bytes) m = std::max(m, per.count(axis) ? per.at(axis) : 0);
            return m;
          };
          fmt::print("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", pp, dp, tp,
                     pp > 1 ? name : "-", zero, kib(most("pp")), kib(most("dp")), kib(most("tp")),
                     kib(most("embedding")), mib(*std::max_element(peak.begin(), peak.end())),
                     mib(*std::min_element(peak.begin(), peak.end())));
        }
      }
    }
  }
  fmt::print("\nBytes are the most any one rank sent on that axis in the step (communicator.h's "
             "wire convention).\n");
  return 0;
}
