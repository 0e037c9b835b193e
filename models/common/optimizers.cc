#include "models/common/optimizers.h"

#include "models/common/flags.h"
#include "optim/adafactor.h"
#include "optim/adamw.h"
#include "optim/sgd.h"
#include "tensor/error.h"

namespace tessera::models {

void validate_optimizer(const char* program, const OptimizerChoice& c) {
  require_one_of(program, "optimizer", c.name, {"adamw", "adafactor", "sgd"});
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

bool optimizer_is_elementwise(const std::string& name) { return name != "adafactor"; }

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
