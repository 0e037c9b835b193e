// What the training of every layout in models/gpt shares, private to the train library:
// the validation loss and the closing sample (inference.cc), the loop's options and the
// run's summary (train.cc: single device, data parallel, ZeRO), which train_3d.cc (pipeline
// and tensor parallel) uses too, and train_rank_3d (train_3d.cc), which train_gpt calls. In
// namespace train_internal, so their plain names never clash with a public gpt:: function.
//
//   models::LoopOptions o = loop_options(config, replica.resume(), verbose);
//   const models::LoopResult loop = models::run_loop(replica, o, meter, progress, metrics);
//   finish_run(result, config, replica, loop, meter, metrics, kCPU, detail, verbose, say);
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "models/common/progress.h"
#include "models/common/train_loop.h"
#include "models/gpt/data.h"
#include "models/gpt/model.h"
#include "models/gpt/train.h"
#include "optim/optimizer.h"
#include "parallel/comm/communicator.h"

namespace tessera::gpt {
namespace train_internal {

// The mean loss over the first `max_batches` (0: all) validation batches, on the model's
// device, in eval mode under autocast to `low`.
double evaluate(Gpt& model, const GptData& batches, int64_t max_batches, DType low);

// The sample at the end of a run into result.sample; a failure is kept in sample_error
// unless the sample is `collective` (then it rethrows: see train.cc).
void sample_into(GptResult& result, Gpt& model, const GptTrainConfig& config, DType low,
                 const std::function<void(const std::string&)>& say, bool collective = false);

// The optimizer in the run's first line ("AdamW8bit", "Adafactor (hf)").
std::string optimizer_label(const optim::Optimizer& opt, const GptTrainConfig& c);

// What the loop takes from the configuration, the same for every layout.
models::LoopOptions loop_options(const GptTrainConfig& config, int64_t start, bool verbose);

// After the loop, for every layout: the final validation (collective), the result's
// fields from the loop, and the summary (`detail()` follows the tokens/s).
void finish_run(GptResult& result, const GptTrainConfig& config, models::Replica& replica,
                const models::LoopResult& loop, const models::StepMeter& meter,
                models::MetricsWriter& metrics, Device device,
                const std::function<std::string()>& detail, bool verbose,
                const std::function<void(const std::string&)>& say);

// One rank of a pipeline / tensor-parallel run (train_3d.cc).
GptResult train_rank_3d(const GptTrainConfig& config, parallel::CommPtr world);

}  // namespace train_internal

using train_internal::evaluate;
using train_internal::finish_run;
using train_internal::loop_options;
using train_internal::optimizer_label;
using train_internal::sample_into;
using train_internal::train_rank_3d;

}  // namespace tessera::gpt
