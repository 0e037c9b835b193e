#include "models/common/offload_flags.h"

#include "tensor/error.h"

namespace tessera::models {

void bind_offload_flags(Flags& f, OffloadChoice& c) {
  f.bind("offload_optimizer", c.optimizer,
         "with --zero 1-3: optimizer state, f32 parameter copies and gradient shards on the "
         "host or in a swap file (none, host, nvme); the update runs on the CPU");
  f.bind("offload_params", c.params,
         "with --zero 3 and --offload_optimizer: parameter shards off the device too (none, "
         "host, nvme)");
  f.bind("offload_dir", c.dir, "where the nvme tier's swap files go (default $TMPDIR or /tmp)");
  f.bind("offload_window", c.window_mib,
         "nvme tier: MiB of host memory for pages read ahead during backward for the step and "
         "for updated pages still being written after it (0: none; the same numbers either way)");
}

parallel::OffloadOptions offload_options(const char* program, const OffloadChoice& c,
                                         const OffloadContext& run) {
  parallel::OffloadOptions o;
  o.optimizer = parallel::parse_offload_tier(c.optimizer, fmt::format("{}: --offload_optimizer", program));
  o.params = parallel::parse_offload_tier(c.params, fmt::format("{}: --offload_params", program));
  o.dir = c.dir;
  TS_CHECK(c.window_mib >= 0 && c.window_mib <= (int64_t{1} << 30),
           "{}: --offload_window must be in [0, 2^30] MiB, got {}", program, c.window_mib);
  o.window = c.window_mib << 20;
  if (!o.any()) return o;
  TS_CHECK(run.zero >= 1 && !run.other_layouts,
           "{}: --offload_optimizer={} --offload_params={} offloads ZeRO's shards: it needs "
           "--zero 1-3 on the --dp layout (got --zero {}{})",
           program, c.optimizer, c.params, run.zero, run.other_layouts ? " with --pp/--tp" : "");
  TS_CHECK(o.optimizer != parallel::OffloadTier::none,
           "{}: --offload_params={} puts the parameter shards with the optimizer's copies: set "
           "--offload_optimizer too", program, c.params);
  TS_CHECK(o.params == parallel::OffloadTier::none || run.zero == 3,
           "{}: --offload_params={} needs --zero 3 (stages 1-2 keep whole parameters), got "
           "--zero {}", program, c.params, run.zero);
  TS_CHECK((run.optimizer == "adamw" || run.optimizer == "sgd") && run.compress == "none" &&
               run.ep == 1,
           "{}: offloading steps flat shards with an elementwise optimizer: --optimizer=adamw "
           "or sgd, no --compress and no --ep (got --optimizer={} --compress={} --ep {})",
           program, run.optimizer, run.compress, run.ep);
  return o;
}

}  // namespace tessera::models
