// The flag parser (models/common/flags.h) with the gpt program's whole flag table
// (models/gpt/cli.h), then the checks train_gpt makes before any work (validation and the
// memory prediction): arbitrary command lines parse or throw tessera::Error, and a
// configuration that validates has a finite, non-negative memory prediction.
// Input: the arguments separated by NUL bytes.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "models/gpt/cli.h"
#include "models/gpt/run_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  std::vector<std::string> args = {"gpt"};
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  args.push_back(cur);
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") return 0;  // prints the table and exits, by design
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  gpt::GptCli cli;
  models::Flags flags = gpt::gpt_flags(cli);
  try {
    flags.parse(static_cast<int>(argv.size()), argv.data());
    const gpt::GptTrainConfig c = gpt::finish(cli);
    gpt::validate_train_config(c);
    const gpt::GptMemoryEstimate m = gpt::estimate_gpt_memory(c, 1);
    if (!(m.total() >= 0) || std::isnan(m.total())) std::abort();
  } catch (const Error&) {
  }
  return 0;
}
