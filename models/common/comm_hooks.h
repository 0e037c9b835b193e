// The examples' gradient compression (--compress): the data-parallel comm hook a flag names,
// and its state in checkpoints. A hook's state differs per rank (error feedback), so a
// checkpoint keeps every rank's, stacked: "comm.<key>" [ranks, ...], gathered over the
// data-parallel group, and a resume takes its own rank's row (the same number of ranks).
//
//   auto hook = models::make_comm_hook("gpt", config.compress, seed);   // null for "none"
//   state.merge(models::gather_hook_state(*hook, comm, zero));            // collective
//   models::load_hook_state("gpt", hook.get(), &comm, dict, zero);        // takes comm.* out
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/common/flags.h"
#include "optim/optimizer.h"
#include "parallel/comm/communicator.h"
#include "parallel/powersgd.h"

namespace tessera::models {

// The examples' gradient compression flags (gpt and mnist bind them alike).
struct CompressChoice {
  std::string name = "none";  // --compress: none | powersgd | onebit_adam
  int64_t powersgd_rank = 1;  // PowerSGD's rank
  int64_t powersgd_start = 10;  // exact steps before PowerSGD compresses
  int64_t onebit_freeze = 0;  // 1-bit Adam's AdamW warm-up steps (0: 20% of the run's steps)
  std::string onebit_send = "update";  // update (m / (sqrt(v) + eps)) | momentum (m)
  std::string onebit_scale = "l1";     // l1 (mean |x|) | l2 (||x|| / sqrt(n))
  bool onebit_bound = true;            // clamp the sent update to Adam's step bound
};

// The flags --compress, --powersgd_rank, --powersgd_start, --onebit_freeze, --onebit_send,
// --onebit_scale and --onebit_bound into `choice`.
void bind_compress_flags(Flags& flags, CompressChoice& choice);
// Each flag's value (Error naming `program`, the flag and the value); 1-bit Adam replaces
// AdamW, so it needs optimizer "adamw".
void validate_compress(const char* program, const CompressChoice& choice,
                       const std::string& optimizer);
// 1-bit Adam's momenta and variances are whole tensors on every rank: Error naming the
// stage for ZeRO 1-3 (PowerSGD composes with every stage).
void require_compress_zero(const char* program, const CompressChoice& choice, int64_t zero);
// 1-bit Adam (parallel/onebit_adam.h) with `hook` (make_comm_hook's for "onebit_adam") over
// `comm`, for a run of `total_steps` steps.
std::unique_ptr<optim::Optimizer> make_onebit_adam(const CompressChoice& choice,
                                                   std::vector<optim::ParamGroup> groups,
                                                   parallel::Communicator& comm,
                                                   std::shared_ptr<parallel::CommHook> hook,
                                                   double lr, std::pair<double, double> betas,
                                                   double weight_decay, int64_t total_steps);
// The progress line's part: "  <hook> sent S of U gradient elements (Rx)" for its last round.
std::string hook_traffic(const parallel::CommHook& hook);

// "none" (null), "powersgd" (its rank and start from `choice`, its initial Qs keyed by
// `seed`) or "onebit_adam" (the hook a parallel::OnebitAdam then attaches to); Error naming
// `program` and the value otherwise.
std::shared_ptr<parallel::CommHook> make_comm_hook(const char* program, const CompressChoice& choice,
                                                   uint64_t seed);

// Every rank's hook state as "comm.<key>" tensors [comm.size(), ...]; collective over `comm`
// (every member gets them all). `zero`: the ZeRO stage whose buckets the hook reduced
// (stage 0: DDP's buckets; 1-3: the segments), kept as "comm.zero".
std::map<std::string, Tensor> gather_hook_state(const parallel::CommHook& hook,
                                                parallel::Communicator& comm, int64_t zero);

// Takes the "comm." entries out of `dict` and, with a hook (and its group `comm`), loads this
// rank's row of each into it. Error naming the flags when they were saved by another kind of
// hook, another number of ranks or under another ZeRO stage (the buckets differ). Without
// "comm." entries the hook starts afresh; without a hook they are dropped (a run resumed
// without --compress).
void load_hook_state(const char* program, parallel::CommHook* hook, parallel::Communicator* comm,
                     optim::Optimizer::StateDict& dict, int64_t zero);

// For layouts whose ranks hold different parameters (--pp, --tp): each rank's hook state
// as "comm.r<world rank>.<key>", with "comm.kind" and "comm.layout" (`layout`, e.g. pp, dp,
// tp, zero, checked on resume). world_hook_state is collective over `world` and every rank
// gets every rank's entries (the keys, dtypes and shapes travel first); own_hook_state is
// this rank's alone (a sharded checkpoint's writer adds its own), kind and layout on rank 0.
std::map<std::string, Tensor> world_hook_state(const parallel::CommHook& hook,
                                               parallel::Communicator& world,
                                               const std::vector<int64_t>& layout);
std::map<std::string, Tensor> own_hook_state(const parallel::CommHook& hook, int rank,
                                             const std::vector<int64_t>& layout);
// Takes the "comm." entries out of `dict` and, with a hook, loads this rank's (`rank`);
// Error naming the flags when another hook or another layout (`layout_flags` names its
// parts: "--pp, --dp, --tp, --zero") saved them. Without entries the hook starts afresh.
void load_world_hook_state(const char* program, parallel::CommHook* hook, int rank,
                           optim::Optimizer::StateDict& dict, const std::vector<int64_t>& layout,
                           const char* layout_flags);

}  // namespace tessera::models
