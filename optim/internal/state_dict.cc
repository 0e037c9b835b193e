#include "optim/internal/state_dict.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <vector>

#include "tensor/ops.h"

namespace tessera::optim::internal {

Tensor scalar_f64(double value) { return Tensor::from_vector<double>({value}, {}); }
Tensor scalar_i64(int64_t value) { return Tensor::from_vector<int64_t>({value}, {}); }

namespace {

// At most a few names, so a wholly wrong dict gives a readable message.
std::string some(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 5;
  std::vector<std::string> shown;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) shown.push_back("'" + keys[i] + "'");
  std::string s = fmt::format("{}", fmt::join(shown, ", "));
  if (keys.size() > kShown) s += fmt::format(" and {} more", keys.size() - kShown);
  return s;
}

}  // namespace

void check_keys(const std::string& who, const StateDict& dict,
                const std::map<std::string, KeySpec>& expected) {
  std::vector<std::string> missing, unexpected;
  for (const auto& [key, spec] : expected) {
    if (dict.count(key) == 0) missing.push_back(key);
  }
  for (const auto& [key, t] : dict) {
    if (expected.count(key) == 0) unexpected.push_back(key);
  }
  if (!missing.empty()) {
    fail("{}.load_state_dict: missing key{} {}", who, missing.size() > 1 ? "s" : "",
         some(missing));
  }
  if (!unexpected.empty()) {
    fail("{}.load_state_dict: unexpected key{} {}", who, unexpected.size() > 1 ? "s" : "",
         some(unexpected));
  }
  for (const auto& [key, spec] : expected) {
    const Tensor& t = dict.at(key);
    TS_CHECK(t.defined(), "{}.load_state_dict: '{}' is an undefined tensor", who, key);
    if (t.shape() != spec.shape || t.dtype() != spec.dtype) {
      fail("{}.load_state_dict: '{}' is {} {} but this {} expects {} {}", who, key, t.dtype(),
           shape_str(t.shape()), who, spec.dtype, shape_str(spec.shape));
    }
  }
}

double get_f64(const StateDict& dict, const std::string& key) {
  return dict.at(key).item<double>();
}

int64_t get_i64(const StateDict& dict, const std::string& key) {
  return dict.at(key).item<int64_t>();
}

}  // namespace tessera::optim::internal
