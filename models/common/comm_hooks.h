// The examples' gradient compression (--compress): the data-parallel comm hook a flag names,
// and its state in checkpoints. A hook's state differs per rank (error feedback), so a
// checkpoint keeps every rank's, stacked: "comm.<key>" [ranks, ...], gathered over the
// data-parallel group, and a resume takes its own rank's row (the same number of ranks).
//
//   auto hook = models::make_comm_hook("gpt", config.compress, {...});   // null for "none"
//   state.merge(models::gather_hook_state(*hook, comm));                  // collective
//   models::load_hook_state("gpt", hook.get(), &comm, dict);              // takes comm.* out
#pragma once

#include <map>
#include <memory>
#include <string>

#include "optim/optimizer.h"
#include "parallel/comm/communicator.h"
#include "parallel/powersgd.h"

namespace tessera::models {

// "none" (null), "powersgd" or "onebit_adam" (the hook a parallel::OnebitAdam then attaches
// to); Error naming `program` and the value otherwise.
std::shared_ptr<parallel::CommHook> make_comm_hook(const char* program, const std::string& name,
                                                   const parallel::PowerSgdOptions& powersgd);

// Every rank's hook state as "comm.<key>" tensors [comm.size(), ...]; collective over `comm`
// (every member gets them all).
std::map<std::string, Tensor> gather_hook_state(const parallel::CommHook& hook,
                                                parallel::Communicator& comm);

// Takes the "comm." entries out of `dict` and, with a hook (and its group `comm`), loads this
// rank's row of each into it. Error when they were saved by another kind of hook or another
// number of ranks. Without "comm." entries the hook starts afresh; without a hook they are
// dropped (a run resumed without --compress).
void load_hook_state(const char* program, parallel::CommHook* hook, parallel::Communicator* comm,
                     optim::Optimizer::StateDict& dict);

}  // namespace tessera::models
