// Checkpoint loading (models/common/checkpoint.h) on arbitrary model and state files, into a
// small model, AdamW and a loss scaler: it loads or throws tessera::Error, nothing else.
// Input: u32 length of the model file, the model file, then the state file; a leading bit
// also writes the second pair (the previous checkpoint the loader may fall back on).
#include <cstdint>

#include "models/common/checkpoint.h"
#include "nn/layers.h"
#include "optim/adamw.h"
#include "tools/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  fuzz::Bytes in(data, size);
  const uint8_t mode = in.u8();
  const std::string model_bytes = in.take(in.u32());
  const std::string state_bytes = mode & 1 ? in.take(in.u32()) : in.rest();
  const std::string path = fuzz::write_file("c.safetensors", model_bytes);
  fuzz::write_file("c.state.safetensors", state_bytes);
  if (mode & 1) {
    fuzz::write_file("c.prev.safetensors", in.take(in.u32()));
    fuzz::write_file("c.prev.state.safetensors", in.rest());
  } else {
    std::remove((fuzz::scratch_dir() + "/c.prev.safetensors").c_str());
    std::remove((fuzz::scratch_dir() + "/c.prev.state.safetensors").c_str());
  }
  nn::Linear model(3, 2);
  optim::AdamW opt(model.parameters(), {.lr = 0.1});
  optim::DynamicLossScaler scaler({.enabled = (mode & 2) != 0});
  try {
    const models::TrainingState s = models::load_checkpoint(path, model, opt, scaler);
    if (s.loaded_from.empty()) std::abort();
  } catch (const Error&) {
  }
  return 0;
}
