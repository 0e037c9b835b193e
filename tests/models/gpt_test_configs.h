// The small GPT runs gpt_train_test, gpt_optimizers_test and gpt_activation_memory_test
// share (the testonly library :gpt_test_configs): tiny() (one layer, width 32, 60 steps on
// the fortunes corpus, validation and a sample) and short_run(steps) (the same model for
// comparing layouts: no sample, validation at the end only, one kernel thread per rank).
//
//   GptTrainConfig c = short_run(8);
//   c.dp = 2;
//   const GptResult r = train_gpt(c);
#pragma once

#include <cstdint>

#include "models/gpt/train.h"

namespace tessera::gpt {

inline GptTrainConfig tiny() {
  GptTrainConfig c;
  c.layers = 1;
  c.heads = 2;
  c.width = 32;
  c.context = 32;
  c.batch = 8;
  c.steps = 60;
  c.lr = 1e-2;
  c.warmup = 10;
  c.val_every = 20;
  c.val_batches = 4;
  c.sample_length = 50;
  c.verbose = false;
  c.threads = 2;
  return c;
}

// tiny() for comparing layouts: `steps` steps, validation only at the end (2 batches), no
// sample, one kernel thread per rank.
inline GptTrainConfig short_run(int64_t steps) {
  GptTrainConfig c = tiny();
  c.steps = steps;
  c.val_every = 0;
  c.val_batches = 2;
  c.sample_length = 0;
  c.threads = 1;
  return c;
}

}  // namespace tessera::gpt
