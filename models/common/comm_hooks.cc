#include "models/common/comm_hooks.h"

#include <fmt/format.h>

#include <vector>

#include "parallel/comm/comm_log.h"
#include "parallel/onebit_adam.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::models {
namespace {

// A name as a tensor (its bytes as i64), for the checkpoint to say which hook wrote it.
Tensor name_tensor(const std::string& name) {
  std::vector<int64_t> bytes(name.begin(), name.end());
  return Tensor::from_vector<int64_t>(bytes, {static_cast<int64_t>(bytes.size())});
}

std::string name_of(const Tensor& t) {
  std::string out;
  for (int64_t c : t.to_vector<int64_t>()) out.push_back(static_cast<char>(c));
  return out;
}

}  // namespace

std::shared_ptr<parallel::CommHook> make_comm_hook(const char* program, const std::string& name,
                                                   const parallel::PowerSgdOptions& powersgd) {
  if (name == "none") return nullptr;
  if (name == "powersgd") return std::make_shared<parallel::PowerSgd>(powersgd);
  if (name == "onebit_adam") return std::make_shared<parallel::OnebitAdamHook>();
  fail("{}: --compress must be none, powersgd or onebit_adam, got '{}'", program, name);
}

std::map<std::string, Tensor> gather_hook_state(const parallel::CommHook& hook,
                                                parallel::Communicator& comm) {
  parallel::CommCause cause("checkpoint comm hook state", parallel::CommKind::control);
  std::map<std::string, Tensor> out;
  for (const auto& [key, v] : hook.state_dict()) {
    Shape shape = v.shape();
    shape.insert(shape.begin(), comm.size());
    const Tensor all = Tensor::empty(shape, v.dtype(), v.device());
    comm.all_gather(all, v.contiguous());
    out["comm." + key] = all;
  }
  out["comm.kind"] = name_tensor(hook.name());
  return out;
}

void load_hook_state(const char* program, parallel::CommHook* hook, parallel::Communicator* comm,
                     optim::Optimizer::StateDict& dict) {
  std::map<std::string, Tensor> saved;
  for (auto it = dict.begin(); it != dict.end();) {
    if (it->first.starts_with("comm.")) {
      saved[it->first.substr(5)] = it->second;
      it = dict.erase(it);
    } else {
      ++it;
    }
  }
  if (hook == nullptr || saved.empty()) return;
  TS_CHECK(comm != nullptr, "{}: a comm hook needs a data-parallel group", program);
  const std::string kind = saved.count("kind") ? name_of(saved.at("kind")) : "";
  TS_CHECK(kind == hook->name(),
           "{}: the checkpoint's gradient compression state is {}'s, not {}'s: resume with "
           "--compress={}",
           program, kind.empty() ? "an unnamed hook" : kind, hook->name(),
           kind.empty() ? "none" : kind);
  saved.erase("kind");
  std::map<std::string, Tensor> mine;
  for (const auto& [key, v] : saved) {
    TS_CHECK(v.dim() >= 1 && v.size(0) == comm->size(),
             "{}: the checkpoint holds the gradient compression state of {} data-parallel "
             "ranks ('comm.{}' {}); this run has {}: resume with as many (the error feedback "
             "is per rank)",
             program, v.dim() >= 1 ? v.size(0) : 0, key, shape_str(v.shape()), comm->size());
    mine[key] = v.select(0, comm->rank()).contiguous().clone();
  }
  hook->load_state_dict(mine);
}

}  // namespace tessera::models
