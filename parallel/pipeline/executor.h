// Runs a pipeline schedule (schedule.h) for one training step on this rank: the forward and
// backward of this rank's model chunks on each micro-batch, in the schedule's order, with
// activations and gradients sent to and received from the neighbouring stages' ranks over
// the pipeline communicator.
//
//   PipelineChunks chunks = {[&](const Tensor& x, int mb) { return stage0(x); }};  // this rank's
//   PipelineStep step = run_pipeline(pp, one_f_one_b(pp.size(), m), chunks,
//                                    [&](int mb) { return inputs[mb]; },      // stage 0
//                                    [&](const Tensor& out, int mb) { return loss(out, mb); });
//   opt.step();   // the parameters' .grad hold the gradient of the mean micro-batch loss
//
// The loss of the step is the mean of the micro-batch losses, so with equal micro-batches
// the gradients are those of one backward over the whole batch. Transfers carry their shape
// and dtype (a small header message), so stages may change shapes. With recompute, each
// chunk's forward keeps only its input (autograd::checkpoint) and reruns in backward.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "parallel/comm/communicator.h"
#include "parallel/pipeline/schedule.h"

namespace tessera::parallel::pipeline {

// A chunk's forward of one micro-batch (the index: a chunk that draws random numbers keys
// them by the micro-batch's rows). With recompute, backward calls it again with the same
// micro-batch.
using PipelineChunk = std::function<Tensor(const Tensor& input, int microbatch)>;
using PipelineChunks = std::vector<PipelineChunk>;  // this rank's chunks, in chunk order

struct PipelineOptions {
  bool recompute = false;   // activation recomputation per chunk
  double loss_scale = 1.0;  // backward starts from loss x this (f16 loss scaling); the
                            // reported loss is unscaled
};

struct PipelineStep {
  double loss = 0.0;     // the mean micro-batch loss (on every rank: broadcast from the last)
  int peak_live = 0;     // the most micro-batch chunks whose activations this rank kept
  std::vector<Action> executed;  // the compute actions, in the order this rank ran them
};

// Collective over `pp` (every member, the same schedule; pp.size() == schedule.ranks).
// `input(mb)` is called on the rank of stage 0, `loss(output, mb)` on the rank of the last
// stage. Gradients accumulate into the parameters' .grad (zero them before the step).
PipelineStep run_pipeline(Communicator& pp, const Schedule& schedule, const PipelineChunks& chunks,
                          const std::function<Tensor(int microbatch)>& input,
                          const std::function<Tensor(const Tensor& output, int microbatch)>& loss,
                          PipelineOptions options = {});

// Collective over `pp`: every micro-batch's forward through every stage, without gradients
// and in stage order (no overlap: for passes that only look, such as the routing pass of
// Mixture-of-Experts blocks). The last stage's outputs are dropped.
void run_pipeline_forward(Communicator& pp, const Schedule& schedule, const PipelineChunks& chunks,
                          const std::function<Tensor(int microbatch)>& input);

}  // namespace tessera::parallel::pipeline
