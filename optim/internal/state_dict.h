// Helpers shared by the optim/ classes' state_dict / load_state_dict: scalars as 0-d
// tensors, and key validation that names the offending key and both shapes.
//
//   dict["scale"] = scalar_f64(65536.0);
//   check_keys("DynamicLossScaler", dict, {{"scale", {{}, DType::f64}}});
#pragma once

#include <map>
#include <string>

#include "tensor/tensor.h"

namespace tessera::optim::internal {

using StateDict = std::map<std::string, Tensor>;

struct KeySpec {
  Shape shape;
  DType dtype;
};

Tensor scalar_f64(double value);
Tensor scalar_i64(int64_t value);

// Throws Error (naming `who`) when a key of `expected` is missing from `dict`, when `dict`
// has a key `expected` lacks, or when a tensor's shape or dtype differs from its spec.
void check_keys(const std::string& who, const StateDict& dict,
                const std::map<std::string, KeySpec>& expected);

// The value of a 0-d tensor under `key` (already checked by check_keys).
double get_f64(const StateDict& dict, const std::string& key);
int64_t get_i64(const StateDict& dict, const std::string& key);

}  // namespace tessera::optim::internal
