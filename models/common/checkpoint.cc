#include "models/common/checkpoint.h"

#include <fmt/format.h>

#include <chrono>
#include <random>

#include "nn/safetensors.h"

namespace tessera::models {
namespace {

constexpr const char* kOptimPrefix = "optimizer.";
constexpr const char* kScalerPrefix = "scaler.";

Tensor i64_scalar(uint64_t v) {
  return Tensor::from_vector<int64_t>({static_cast<int64_t>(v)}, {});
}

int64_t read_i64(const nn::SafetensorsFile& f, const std::string& key, const std::string& path) {
  auto it = f.tensors.find(key);
  TS_CHECK(it != f.tensors.end(), "load_checkpoint: {} has no entry '{}'", path, key);
  TS_CHECK(it->second.dtype() == DType::i64 && it->second.numel() == 1,
           "load_checkpoint: {} entry '{}' should be one i64, got {} {}", path, key,
           it->second.dtype(), shape_str(it->second.shape()));
  return it->second.item<int64_t>();
}

std::map<std::string, Tensor> with_prefix(const std::map<std::string, Tensor>& all,
                                          const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (const auto& [k, v] : all) {
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  }
  return out;
}

std::string new_checkpoint_id() {
  std::random_device rd;
  const uint64_t t = std::chrono::steady_clock::now().time_since_epoch().count();
  return fmt::format("{:016x}", (static_cast<uint64_t>(rd()) << 32 ^ rd()) ^ t);
}

}  // namespace

std::string state_path(const std::string& path) {
  const std::string ext = ".safetensors";
  if (path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0) {
    return path.substr(0, path.size() - ext.size()) + ".state" + ext;
  }
  return path + ".state" + ext;
}

void save_checkpoint(const std::string& path, const nn::Module& model,
                     const optim::Optimizer& optimizer, const optim::DynamicLossScaler& scaler,
                     const TrainingState& state) {
  save_checkpoint(path, model.state_dict(), optimizer.state_dict(), scaler, state);
}

void save_checkpoint(const std::string& path, const nn::StateDict& model,
                     const optim::Optimizer::StateDict& optimizer,
                     const optim::DynamicLossScaler& scaler, const TrainingState& state) {
  const std::string id = new_checkpoint_id();
  std::map<std::string, Tensor> extra;
  for (const auto& [k, v] : optimizer) extra[kOptimPrefix + k] = v;
  for (const auto& [k, v] : scaler.state_dict()) extra[kScalerPrefix + k] = v;
  extra["progress.step"] = i64_scalar(state.step);
  extra["progress.epoch"] = i64_scalar(state.epoch);
  extra["progress.batch_index"] = i64_scalar(state.batch_index);
  extra["rng.seed"] = i64_scalar(state.rng_seed);
  extra["rng.offset"] = i64_scalar(state.rng_offset);
  std::map<std::string, std::string> meta = {{"format", "tessera-checkpoint"},
                                             {"checkpoint_id", id},
                                             {"step", std::to_string(state.step)}};
  // The state first: a crash before the model's rename leaves a mismatched id, not a model
  // that claims a state it does not have.
  nn::save_safetensors(state_path(path), extra, meta);
  std::map<std::string, std::string> model_meta = meta;
  for (const auto& [k, v] : state.info) model_meta["info." + k] = v;
  nn::save_safetensors(path, model, model_meta);
}

TrainingState load_checkpoint(const std::string& path, nn::Module& model,
                              optim::Optimizer& optimizer, optim::DynamicLossScaler& scaler) {
  return load_checkpoint(
      path,
      [&](const nn::StateDict& weights, const optim::Optimizer::StateDict& optim_state) {
        model.load_state_dict(weights);
        optimizer.load_state_dict(optim_state);
      },
      scaler);
}

TrainingState load_checkpoint(const std::string& path, const ApplyCheckpoint& apply,
                              optim::DynamicLossScaler& scaler) {
  const nn::SafetensorsFile weights = nn::load_safetensors(path);
  const std::string spath = state_path(path);
  const nn::SafetensorsFile extra = nn::load_safetensors(spath);
  auto id_of = [](const nn::SafetensorsFile& f) {
    auto it = f.metadata.find("checkpoint_id");
    return it == f.metadata.end() ? std::string("(none)") : it->second;
  };
  TS_CHECK(id_of(weights) == id_of(extra) && id_of(weights) != "(none)",
           "load_checkpoint: {} (checkpoint id {}) and {} (checkpoint id {}) are not from the "
           "same save; the save was interrupted or the files were mixed",
           path, id_of(weights), spath, id_of(extra));
  try {
    apply(weights.tensors, with_prefix(extra.tensors, kOptimPrefix));
    scaler.load_state_dict(with_prefix(extra.tensors, kScalerPrefix));
  } catch (const Error& e) {
    fail("load_checkpoint: {} does not fit this model or optimizer: {}", path, e.what());
  }
  TrainingState s;
  s.step = read_i64(extra, "progress.step", spath);
  s.epoch = read_i64(extra, "progress.epoch", spath);
  s.batch_index = read_i64(extra, "progress.batch_index", spath);
  s.rng_seed = static_cast<uint64_t>(read_i64(extra, "rng.seed", spath));
  s.rng_offset = static_cast<uint64_t>(read_i64(extra, "rng.offset", spath));
  for (const auto& [k, v] : weights.metadata) {
    if (k.rfind("info.", 0) == 0) s.info[k.substr(5)] = v;
  }
  return s;
}

}  // namespace tessera::models
