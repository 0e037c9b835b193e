// The optimizer an example trains with, chosen by flags (--optimizer and its hyper-
// parameters), shared by the GPT and MNIST programs.
//
//   OptimizerChoice o;  o.name = "adafactor";  o.lr = 1e-3;
//   std::unique_ptr<optim::Optimizer> opt = make_optimizer("gpt", o, groups);
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "optim/optimizer.h"

namespace tessera::models {

struct OptimizerChoice {
  std::string name = "adamw";  // adamw | adafactor | sgd
  double lr = 1e-3, weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;  // adamw
  // adafactor (optim/adafactor.h), following the lr schedule (no relative step): the mode
  // (hf, torch, optax), its first moment (0: none, the memory-saving default) and whether
  // the step is scaled by the parameter's RMS.
  std::string adafactor_mode = "hf";
  double adafactor_beta1 = 0.0;
  bool adafactor_scale_parameter = false;
  double momentum = 0.9;  // sgd
};

// Error naming `program` and the flag for an unknown optimizer or a bad value.
void validate_optimizer(const char* program, const OptimizerChoice& choice);
std::unique_ptr<optim::Optimizer> make_optimizer(const char* program, const OptimizerChoice& choice,
                                                 std::vector<optim::ParamGroup> groups);
// Whether the optimizer updates each element from that element alone (ZeRO's flat shards
// need it): adamw and sgd yes, adafactor no.
bool optimizer_is_elementwise(const std::string& name);

}  // namespace tessera::models
