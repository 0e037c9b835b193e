// The equivalence checker for GPT (`gpt --check`; parallel/equivalence.h does the comparing).
// The configured layout (models/gpt/parallel3d.h: any pp x dp x tp, sp, ZeRO 0-3, schedule,
// accumulation, recomputation, dropout) and the single-device model train side by side in
// f64, on every rank, from the same seed and batches. After each step every layer's output
// (the layout's gathered over the ranks that computed it), the loss, every parameter's
// gradient and every updated parameter are compared by name; the first mismatch beyond the
// tolerance stops the run and names the step, the phase, the tensor, the ranks that computed
// it, the errors and the layout.
//
//   GptTrainConfig c;  c.pp = 2;  c.dp = 2;  c.steps = 3;
//   parallel::run_threads(4, [&](parallel::CommPtr world) {
//     GptCheckResult r = check_gpt(c, world);    // r.ok, r.report
//   });
#pragma once

#include <cstdint>
#include <string>

#include "models/gpt/parallel3d.h"
#include "models/gpt/train.h"
#include "parallel/comm/communicator.h"

namespace tessera::gpt {

struct GptCheckResult {
  bool ok = true;
  int64_t steps = 0;     // steps compared (up to and including a mismatch's)
  int64_t compared = 0;  // tensors found equal
  double worst = 0.0;    // their largest relative error
  std::string report;    // one paragraph: every step equal, or the first mismatch
};

// The Gpt3d options a training configuration asks for (the gpt program's 3-D path).
Gpt3dOptions gpt3d_options(const GptTrainConfig& config);

// Collective over `world` (config.pp x dp x tp ranks): every rank runs the layout's part and
// the whole single-device run, and returns the same result. config.check_tolerance bounds the
// relative error of each tensor; config.inject names a bug to inject (Gpt3dOptions::inject).
// Error for a precision other than f32 (the check runs in f64, so that rounding never hides
// or fakes a difference).
GptCheckResult check_gpt(const GptTrainConfig& config, parallel::CommPtr world);

}  // namespace tessera::gpt
