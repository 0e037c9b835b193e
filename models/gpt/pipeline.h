// GPT on a pipeline (parallel/pipeline): the model as a stack of pipeline layers
// [embed, h.0, ..., h.{L-1}, head] (embed: token and position embeddings; head: the final
// LayerNorm and the LM head, which reuses the token embedding), split into contiguous stages,
// balanced by parameter count or given by the user.
//
//   GptPipeline pipe = partition_gpt(model, schedule.num_stages());
//   PipelineStep r = run_pipeline(*pp, schedule, pipe.chunks(model, schedule, pp->rank()),
//                                 input, loss);
//   pipe.sync_tied_gradients(model, *pp, schedule);   // wte's grad: first + last stage
//
// Every rank builds the whole model from the same seed and runs only its stages; the token
// embedding is used by the first stage (lookup) and the last (head), so the ranks holding
// those stages sum its gradient (Megatron's embedding group) before the optimizer step.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/gpt/model.h"
#include "parallel/comm/communicator.h"
#include "parallel/pipeline/executor.h"

namespace tessera::gpt {

struct GptPipeline {
  int layers = 0;                // pipeline layers: blocks + 2
  std::vector<int> first_layer;  // per stage: stage s runs layers [first[s], first[s + 1])

  int num_stages() const { return static_cast<int>(first_layer.size()); }
  int end_layer(int stage) const {
    return stage + 1 < num_stages() ? first_layer[stage + 1] : layers;
  }
  // Pipeline layer names: "embed", "h.0", ..., "head".
  std::string layer_name(int layer) const;
  // This rank's chunk functions, in chunk order (schedule.stage_of(rank, c)).
  parallel::pipeline::PipelineChunks chunks(Gpt& model, const parallel::pipeline::Schedule& s,
                                            int rank) const;
  // The parameters this rank's stages use (the tied embedding once), for its optimizer.
  nn::NamedTensors parameters(Gpt& model, const parallel::pipeline::Schedule& s, int rank) const;
  // A module holding this rank's layers under their names in the full model ("wte", "h.3",
  // "ln_f"), for data parallelism / ZeRO over the ranks that share these stages. It shares
  // the layers with `model` (nothing is copied).
  std::shared_ptr<nn::Module> stage_module(Gpt& model, const parallel::pipeline::Schedule& s,
                                           int rank) const;
  // Collective over pp: sums wte's gradient over the ranks of the first and last stages.
  void sync_tied_gradients(Gpt& model, parallel::Communicator& pp,
                           const parallel::pipeline::Schedule& s) const;
  std::string str() const;  // "stage 0: embed h.0 | stage 1: h.1 head"
};

// Balanced by parameter count (the tied head counts once, in embed), or with
// `layers_per_stage` (pipeline layers per stage, summing to blocks + 2). Error when there
// are more stages than pipeline layers.
GptPipeline partition_gpt(const Gpt& model, int stages, const std::vector<int>& layers_per_stage = {});

}  // namespace tessera::gpt
