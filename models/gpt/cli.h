// The gpt program's command line: every flag bound to a GptTrainConfig field (the table
// `gpt --help` prints), shared by models/gpt/main.cc and the flag parser's fuzzer.
//
//   GptCli cli;
//   models::Flags flags = gpt_flags(cli);
//   flags.parse(argc, argv);                 // Error on an unknown flag or a bad value
//   GptTrainConfig config = finish(cli);     // sizes parsed, relative paths resolved
#pragma once

#include <string>

#include "models/common/flags.h"
#include "models/gpt/train.h"

namespace tessera::gpt {

struct GptCli {
  GptTrainConfig config;
  std::string memory_limit = "0";  // --memory_limit as given ("8G")
  bool quiet = false;
};

// Binds every flag into `cli` (which must outlive the returned parser).
models::Flags gpt_flags(GptCli& cli);

// After parse(): --memory_limit in bytes, --quiet as !verbose, relative paths as the user
// meant them (models::from_user_dir). Error naming a bad size.
GptTrainConfig finish(const GptCli& cli);

}  // namespace tessera::gpt
