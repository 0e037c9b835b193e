// The offload flags the example programs share (parallel/offload.h, ZeroOptions::offload):
//
//   models::OffloadChoice offload;
//   models::bind_offload_flags(flags, offload);   // --offload_optimizer/--offload_params/--offload_dir
//   zero_options.offload = models::offload_options("gpt", offload, {.zero = 3});
#pragma once

#include <cstdint>
#include <string>

#include "models/common/flags.h"
#include "parallel/offload.h"

namespace tessera::models {

struct OffloadChoice {
  std::string optimizer = "none";  // --offload_optimizer: none | host | nvme
  std::string params = "none";     // --offload_params: none | host | nvme (ZeRO 3)
  std::string dir = "";            // --offload_dir: the nvme tier's swap files ("": $TMPDIR)
  int64_t window_mib = 512;        // --offload_window: OffloadOptions::window, in MiB
  bool any() const { return optimizer != "none" || params != "none"; }
};

void bind_offload_flags(Flags& flags, OffloadChoice& choice);

// What the rest of the run says, for the checks.
struct OffloadContext {
  int64_t zero = 0;
  bool other_layouts = false;  // --pp or --tp > 1
  std::string optimizer = "adamw";
  std::string compress = "none";
  int64_t ep = 1;
};

// Checks the choice against the run (Error naming `program`, the flags and the values) and
// returns the options for ZeroOptions::offload (none: any() is false).
parallel::OffloadOptions offload_options(const char* program, const OffloadChoice& choice,
                                         const OffloadContext& run);

}  // namespace tessera::models
