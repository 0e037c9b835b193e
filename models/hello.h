// A tiny end-to-end example: an MLP learning three Gaussian blobs in 2-D with plain SGD,
// built from ops and autograd only (nn/ and optim/ wrap the same steps).
//
//   HelloResult r = train_hello({.steps = 300});
//   // r.losses[0] ~ 1.1 (chance), r.accuracy > 0.95
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace tessera::models {

struct HelloConfig {
  int64_t steps = 300;
  int64_t batch = 96;
  int64_t hidden = 32;
  double lr = 0.2;
  uint64_t seed = 0;
  int64_t log_every = 50;  // progress callback period
};

struct HelloResult {
  std::vector<double> losses;  // per step
  double accuracy = 0;         // on a held-out draw of the blobs
};

HelloResult train_hello(const HelloConfig& config,
                        const std::function<void(int64_t step, double loss)>& on_log = {});

}  // namespace tessera::models
