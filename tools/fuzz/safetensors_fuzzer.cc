// The safetensors reader (nn/safetensors.h) on arbitrary bytes: every file either loads into
// tensors that match its header or throws tessera::Error; nothing else (no crash, no other
// exception, no sanitizer report). A file that loads is written back and must reload equal.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "nn/safetensors.h"
#include "tools/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  const std::string path = fuzz::write_file("input.safetensors", data, size);
  try {
    const std::map<std::string, std::string> meta = nn::read_safetensors_metadata(path);
    const nn::SafetensorsFile f = nn::load_safetensors(path);
    if (f.metadata != meta) std::abort();  // the two readers agree
    const std::string again = fuzz::scratch_dir() + "/again.safetensors";
    nn::save_safetensors(again, f.tensors, f.metadata);
    const nn::SafetensorsFile g = nn::load_safetensors(again);
    if (g.metadata != f.metadata || g.tensors.size() != f.tensors.size()) std::abort();
    for (const auto& [name, t] : f.tensors) {
      const Tensor& u = g.tensors.at(name);
      if (u.shape() != t.shape() || u.dtype() != t.dtype() || u.nbytes() != t.nbytes()) std::abort();
      if (t.nbytes() > 0 && std::memcmp(u.raw_data(), t.raw_data(), t.nbytes()) != 0) std::abort();
    }
  } catch (const Error&) {
    // Malformed input: a clear error is the contract.
  }
  return 0;
}
