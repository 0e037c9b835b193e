// Fault injection for the reliability tests (docs/RELIABILITY.md): named points in the
// checkpoint writer and the training loops where a test makes the process die, stop, get a
// signal or throw, deterministically, through one environment variable.
//
//   TESSERA_FAULT=<point>:<action>[:<hit>[:<rank>]]
//     point   a name passed to fault_point(), e.g. checkpoint.state_renamed, train.step
//     action  kill (SIGKILL), stop (SIGSTOP), term (SIGTERM), int (SIGINT), throw (an Error)
//     hit     act on the hit-th time this rank reaches the point (default 1)
//     rank    act only on this rank (default every rank; -1 or absent: single-rank code)
//
//   TESSERA_FAULT=checkpoint.state_renamed:kill:3 gpt --save=x.safetensors --save_every=1
//   // dies between the state file's and the model file's rename of the third save
//
// Unset (production), fault_point() is one relaxed load and a branch.
#pragma once

#include <string_view>

namespace tessera::models {

// Reached `point` (on `rank`; -1: code that has no rank). Acts as TESSERA_FAULT says, or
// returns at once. A malformed TESSERA_FAULT throws Error naming it on the first call.
void fault_point(std::string_view point, int rank = -1);

}  // namespace tessera::models
