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
#include "tensor/shape.h"

namespace tessera::models {

struct OptimizerChoice {
  std::string name = "adamw";  // adamw | adamw8bit | adafactor | sgd
  double lr = 1e-3, weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;  // adamw, adamw8bit
  // adamw8bit (optim/adamw8bit.h): parameters whose name contains one of these keep f32
  // state (the program's embeddings under --stable_embedding, and --f32_state's parts).
  // '.' and '_' match each other: wrappers name shards "h_0_attn_c_proj_weight".
  std::vector<std::string> f32_state_names = {};
  // adafactor (optim/adafactor.h), following the lr schedule (no relative step): the mode
  // (hf, torch, optax), its first moment (0: none, the memory-saving default) and whether
  // the step is scaled by the parameter's RMS.
  std::string adafactor_mode = "hf";
  double adafactor_beta1 = 0.0;
  bool adafactor_scale_parameter = false;
  double momentum = 0.9;  // sgd
};

// Whether parameter `name` keeps f32 state under 8-bit AdamW by f32_state_names.
bool keeps_f32_state(const OptimizerChoice& choice, const std::string& name);
// Error naming `program` and the flag for an unknown optimizer or a bad value.
void validate_optimizer(const char* program, const OptimizerChoice& choice);
std::unique_ptr<optim::Optimizer> make_optimizer(const char* program, const OptimizerChoice& choice,
                                                 std::vector<optim::ParamGroup> groups);
// Whether the optimizer updates each element from that element alone (ZeRO's flat shards
// need it): adamw and sgd yes, adafactor and adamw8bit no.
bool optimizer_is_elementwise(const std::string& name);
// How ZeRO must shard for it: whole rows (adafactor: ZeroOptions::row_shards), whole blocks
// of this many elements (adamw8bit: 256, ZeroOptions::block_shards), or flat (0, false).
bool optimizer_needs_row_shards(const std::string& name);
int64_t optimizer_shard_block(const std::string& name);
// Optimizer-state bytes per parameter element the formula gives for a parameter of `shape`
// (AdamW 8, 8-bit AdamW 2 + 8/256 from 4096 elements and 8 below, Adafactor 4(m+n)/(mn) per
// factored matrix plus 4 with a first moment, SGD 4 with momentum), not counting master
// weights; `f32_state` for an 8-bit parameter kept in f32.
double optimizer_state_formula(const OptimizerChoice& choice, const Shape& shape,
                               bool f32_state = false);
// The formula's bytes over named parameters (f32_state_names applied), master weights (4
// per element) included when `master` (f16/bf16 params under AdamW or 8-bit AdamW).
double optimizer_state_formula_bytes(const OptimizerChoice& choice,
                                     const std::vector<std::pair<std::string, Tensor>>& params,
                                     bool master);

}  // namespace tessera::models
