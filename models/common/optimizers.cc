#include "models/common/optimizers.h"

#include <algorithm>
#include <cmath>

#include "models/common/flags.h"
#include "optim/adafactor.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/sgd.h"
#include "tensor/error.h"
#include "tensor/quant8.h"

namespace tessera::models {

void validate_optimizer(const char* program, const OptimizerChoice& c) {
  require_one_of(program, "optimizer", c.name, {"adamw", "adamw8bit", "adafactor", "sgd"});
  if (c.name == "adafactor") {
    require_one_of(program, "adafactor_mode", c.adafactor_mode, {"hf", "torch", "optax"});
    TS_CHECK(c.adafactor_beta1 >= 0 && c.adafactor_beta1 < 1,
             "{}: --adafactor_beta1 must be in [0, 1), got {}", program, c.adafactor_beta1);
    TS_CHECK(c.adafactor_mode != "torch" || c.adafactor_beta1 == 0,
             "{}: --adafactor_mode=torch has no first moment; --adafactor_beta1 must be 0, got {}",
             program, c.adafactor_beta1);
  }
  if (c.name == "sgd") {
    TS_CHECK(c.momentum >= 0 && c.momentum < 1, "{}: --momentum must be in [0, 1), got {}",
             program, c.momentum);
  }
}

bool optimizer_is_elementwise(const std::string& name) {
  return name != "adafactor" && name != "adamw8bit";
}

bool optimizer_needs_row_shards(const std::string& name) { return name == "adafactor"; }

int64_t optimizer_shard_block(const std::string& name) {
  return name == "adamw8bit" ? kQuant8Block : 0;
}

double optimizer_state_formula(const OptimizerChoice& c, const Shape& shape, bool f32_state) {
  const double n = static_cast<double>(numel_of(shape));
  if (c.name == "adamw8bit") {
    if (f32_state || n < 4096) return 8.0;
    return 2.0 + 8.0 * std::ceil(n / kQuant8Block) / n;
  }
  if (c.name == "adafactor") {
    const double first = c.adafactor_beta1 > 0 ? 4.0 : 0.0;
    if (shape.size() < 2) return 4.0 + first;
    // hf/torch factor the last two dims, the rest batched: rows + columns per matrix. optax
    // factors the two largest dims, when the smaller of them is at least 128 (its default
    // min_dim_size_to_factor, which the programs keep).
    double rows = static_cast<double>(shape[shape.size() - 2]);
    double cols = static_cast<double>(shape.back());
    if (c.adafactor_mode == "optax") {
      std::vector<int64_t> dims(shape.begin(), shape.end());
      std::sort(dims.begin(), dims.end());
      rows = static_cast<double>(dims[dims.size() - 2]);
      cols = static_cast<double>(dims.back());
      if (rows < 128) return 4.0 + first;
    }
    return 4.0 * (rows + cols) / (rows * cols) + first;
  }
  if (c.name == "sgd") return c.momentum > 0 ? 4.0 : 0.0;
  return 8.0;
}

double optimizer_state_formula_bytes(const OptimizerChoice& c,
                                     const std::vector<std::pair<std::string, Tensor>>& params,
                                     bool master) {
  double total = 0;
  for (const auto& [name, t] : params) {
    const bool f32 = keeps_f32_state(c, name);
    const double n = static_cast<double>(t.numel());
    total += n * optimizer_state_formula(c, t.shape(), f32);
    if (master && (c.name == "adamw" || c.name == "adamw8bit")) total += 4 * n;
  }
  return total;
}

bool keeps_f32_state(const OptimizerChoice& c, const std::string& name) {
  const auto flat = [](std::string s) {
    std::replace(s.begin(), s.end(), '.', '_');
    return s;
  };
  const std::string n = flat(name);
  for (const std::string& part : c.f32_state_names) {
    if (!part.empty() && n.find(flat(part)) != std::string::npos) return true;
  }
  return false;
}

std::unique_ptr<optim::Optimizer> make_optimizer(const char* program, const OptimizerChoice& c,
                                                 std::vector<optim::ParamGroup> groups) {
  validate_optimizer(program, c);
  if (c.name == "adafactor") {
    optim::AdafactorOptions o;
    o.mode = optim::parse_adafactor_mode(c.adafactor_mode);
    o.lr = c.lr;
    o.relative_step = false;  // the program's schedule sets lr
    o.scale_parameter = c.adafactor_scale_parameter;
    o.beta1 = c.adafactor_beta1;
    o.weight_decay = c.weight_decay;
    return std::make_unique<optim::Adafactor>(std::move(groups), o);
  }
  if (c.name == "adamw8bit") {
    optim::AdamW8bitOptions o;
    o.lr = c.lr;
    o.betas = {c.beta1, c.beta2};
    o.weight_decay = c.weight_decay;
    if (!c.f32_state_names.empty()) {
      o.f32_state = [c](const std::string& name) { return keeps_f32_state(c, name); };
    }
    return std::make_unique<optim::AdamW8bit>(std::move(groups), o);
  }
  if (c.name == "sgd") {
    optim::SGDOptions o;
    o.lr = c.lr;
    o.momentum = c.momentum;
    o.weight_decay = c.weight_decay;
    return std::make_unique<optim::SGD>(std::move(groups), o);
  }
  optim::AdamWOptions o;
  o.lr = c.lr;
  o.betas = {c.beta1, c.beta2};
  o.weight_decay = c.weight_decay;
  return std::make_unique<optim::AdamW>(std::move(groups), o);
}

}  // namespace tessera::models
