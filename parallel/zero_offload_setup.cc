// ZeroDataParallel's offload tiers outside the training step: the options and the device
// budget checked at construction, each segment's host copy set up (its first writes to the
// swap file), and the report of what the tiers hold and moved (ZeroOffloadReport). Kept
// apart from zero_offload.cc (the paging and the per-step updates) because it runs only at
// construction and on request, and needs only the few helpers zero_offload_state.h declares.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "parallel/placement.h"
#include "parallel/zero.h"
#include "parallel/zero_offload_state.h"
#include "parallel/zero_state.h"

namespace tessera::parallel {

namespace {

std::atomic<int64_t> g_swap_files{0};  // names the swap files of one process apart

// The segments' order in forward (the root, then the units): the step updates them so, and
// the next forward gathers the first ones while the last ones' writes drain.
std::vector<int> forward_order(const State& st) {
  std::vector<int> order(st.segments.size());
  for (size_t s = 0; s < order.size(); ++s) order[s] = static_cast<int>(s);
  auto rank = [&](int s) { return st.segments[s].unit == st.root() ? -1 : st.segments[s].unit; };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank(a) < rank(b); });
  return order;
}

// The least device memory training needs beside the activations, and what it is (from the
// segments: run before the flat buffers exist).
std::pair<int64_t, std::string> least_device_bytes(const State& st) {
  std::vector<int64_t> unit_bytes(st.units.size());
  for (const State::Segment& seg : st.segments) unit_bytes[seg.unit] += seg.numel * dtype_size(seg.dtype);
  if (st.stage() == 3) {
    int64_t largest = 0;
    std::string name = "(none)";
    for (int u = 0; u < st.root(); ++u) {
      if (unit_bytes[u] > largest) largest = unit_bytes[u], name = st.units[u].path;
    }
    const int64_t root = unit_bytes[st.root()];
    return {root * 2 + largest * 2,
            fmt::format("the root's {:.2f} MiB of parameters and their gradients, and unit '{}' "
                        "gathered ({:.2f} MiB) with its gradients",
                        root / 1048576.0, name, largest / 1048576.0)};
  }
  // Stages 1-2: the whole parameters stay (counted in use already, or below when the model
  // was built on the host tier), and a segment's gradients twice (its buffer and the block
  // reduced into).
  int64_t largest = 0;
  for (const State::Segment& seg : st.segments) largest = std::max(largest, seg.numel * dtype_size(seg.dtype));
  return {2 * largest,
          fmt::format("one segment's gradients twice ({:.2f} MiB each) beside the whole "
                      "parameters, which stages 1-2 keep",
                      largest / 1048576.0)};
}

std::string tiers_of(const OffloadOptions& opt) {
  return fmt::format("offload_optimizer={} offload_params={}", offload_tier_name(opt.optimizer),
                     offload_tier_name(opt.params));
}

}  // namespace

void offload_check(State& st) {
  const OffloadOptions& opt = st.options.offload;
  const std::string tiers = tiers_of(opt);
  TS_CHECK(st.stage() >= 1, "{}: {}: offloading needs ZeRO stage 1-3 (the optimizer steps this "
           "rank's shards), got stage {}", kName, tiers, st.stage());
  TS_CHECK(opt.optimizer != OffloadTier::none,
           "{}: {}: the parameters go to the tier of the optimizer's copies; offload the "
           "optimizer too", kName, tiers);
  TS_CHECK(opt.params == OffloadTier::none || st.stage() == 3,
           "{}: {}: offloading the parameters needs ZeRO stage 3 (stages 1-2 keep them whole "
           "on every rank), got stage {}", kName, tiers, st.stage());
  TS_CHECK(!st.options.comm_hook && !st.per_param_shards() && st.options.subgroup.group == nullptr,
           "{}: {}: offloading takes flat shards reduced exactly: not with a comm hook, row or "
           "block shards, or a parameter subgroup (experts)", kName, tiers);
  auto o = std::make_shared<Offload>();
  o->params = opt.params != OffloadTier::none;
  o->state_file = opt.optimizer == OffloadTier::file;
  o->param_file = param_copies_on_file(opt.optimizer, opt.params);
  o->reads.resize(st.segments.size());
  o->ahead.resize(st.segments.size());
  o->writing.resize(st.segments.size());
  o->known.resize(st.segments.size());
  TS_CHECK(opt.window >= 0, "{}: {}: the offload window must be >= 0 bytes, got {}", kName, tiers,
           opt.window);
  o->window = opt.window;
  o->handed.assign(st.segments.size(), 0);
  o->due.assign(st.segments.size(), 0);
  o->grads.resize(st.segments.size());
  o->update_reads.resize(st.segments.size());
  o->lazy = st.stage() == 3 && opt.optimizer == OffloadTier::file;
  o->grad_copies.resize(st.segments.size());
  o->order = forward_order(st);
  st.offload = o;
  // The device budget, against what this rank's device will hold once built: what is in use
  // now, with the parameters' device bytes (none when the model was built on the host tier)
  // replaced by what stays of them: stages 1-2 all (as flat buffers), stage 3 this rank's
  // shards, or none with the parameters offloaded.
  if (st.segments.empty()) return;
  Allocator& device = allocator_for(st.segments.front().device);
  const int64_t cap = device.limit();
  if (cap <= 0) return;
  int64_t on_device = 0, kept = 0;
  std::set<const StorageImpl*> seen;
  for (const State::Param& p : st.params) {
    const StorageImpl* storage = p.tensor.storage().get();
    if (storage->allocator() != nullptr && storage->allocator()->is_device() &&
        seen.insert(storage).second) {
      on_device += storage->nbytes();
    }
  }
  for (const State::Segment& seg : st.segments) {
    const int64_t mine = st.stage() < 3 ? seg.numel
                         : o->params ? 0
                                     : block_size(seg.numel, seg.comm->size(), seg.comm->rank());
    kept += mine * dtype_size(seg.dtype);
  }
  const int64_t in_use = device.stats().allocated_bytes - on_device + kept;
  const auto [need, what] = least_device_bytes(st);
  // Every rank learns whether any is short (threads ranks share one budget and may read it
  // at different moments): all throw, none is left waiting in a collective.
  Tensor short_here = Tensor::from_vector<double>({need <= cap - in_use ? 0.0 : 1.0}, {1});
  {
    CommCause cause("zero offload budget check", CommKind::control);
    st.comm->all_reduce(short_here, ReduceOp::max);
  }
  TS_CHECK(short_here.item<double>() == 0.0 || need > cap - in_use,
           "{}: {}: another rank's device budget cannot hold even one unit", kName, tiers);
  TS_CHECK(need <= cap - in_use,
           "{}: {}: the device budget of {:.2f} MiB ({:.2f} MiB otherwise in use) cannot "
           "hold even one unit: training needs at least {:.2f} MiB more beside the activations, "
           "for {}; raise --memory_limit{}",
           kName, tiers, cap / 1048576.0, in_use / 1048576.0, need / 1048576.0, what,
           st.stage() < 3 ? " or use ZeRO stage 3 with --offload_params" : "");
}

void offload_adopt(State& st, int s) {
  const OffloadOptions& opt = st.options.offload;
  Offload& o = *st.offload;
  if ((o.state_file || o.param_file) && !o.file) {
    o.file = std::make_unique<SwapFile>(
        opt.dir, fmt::format("rank{}-{}", st.comm->rank(), g_swap_files.fetch_add(1)),
        SwapFile::Options{opt.direct_io, opt.io_threads, opt.io_block});
  }
  State::Segment& seg = st.segments[s];
  NoGradGuard no_grad;
  {
    HostTierScope host;
    MemoryTagScope tag(MemoryTag::parameters);
    seg.host = Tensor::empty({seg.shard_numel}, seg.dtype, kCPU);
  }
  seg.host.copy_(seg.shard);
  o.to_host += shard_bytes(seg);
  if (o.params) seg.shard.storage()->release();  // stage 3: its own clone
  // The first writes go on while the next segments are built; offload_finish_setup waits.
  Writes w = write_out(st, s, nullptr);
  for (size_t i = 0; i < w.requests.size(); ++i) {
    o.setup_writes.requests.push_back(std::move(w.requests[i]));
    o.setup_writes.targets.push_back(w.targets[i]);
  }
}

void offload_finish_setup(State& st) {
  Offload& o = *st.offload;
  if (o.lazy && o.params && o.param_file) {  // the pages a step hands to the next forward
    for (const State::Segment& seg : st.segments) o.handoff_bytes += size_of(seg.host);
  }
  wait_writes(o, o.setup_writes.requests, o.setup_writes.targets);
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) release_pages(st, s, nullptr);
}

ZeroOffloadReport ZeroDataParallel::offload_report() const {
  const State& st = *state_;
  ZeroOffloadReport r;
  if (!st.offload) return r;
  const Offload& o = *st.offload;
  r.optimizer = st.options.offload.optimizer;
  r.params = st.options.offload.params;
  if (o.file) {
    r.direct_io = o.file->direct();
    r.file = o.file->path();
    r.file_bytes = o.file->file_bytes();
    r.read_bytes = o.file->bytes_read();
    r.written_bytes = o.file->bytes_written();
    r.io_seconds = o.file->busy_seconds();
    r.window_peak_bytes = o.window_peak;
    r.largest_segment_page_bytes = o.largest_pages;
    r.gather_wait_seconds = o.gather_wait_seconds;
  }
  r.to_host_bytes = o.to_host;
  r.handoff_bytes = o.handoff_bytes;
  r.update_seconds = o.update_seconds;
  r.to_device_bytes = o.to_device;
  r.host_bytes = o.state_host_bytes;
  for (int u = 0; u < static_cast<int>(st.units.size()); ++u) {
    for (int s : st.units[u].segments) {
      const State::Segment& seg = st.segments[s];
      r.shard_elements += seg.shard_numel;
      r.shard_bytes += shard_bytes(seg);
      if (o.params && o.param_file) r.gathered_shard_bytes += shard_bytes(seg) * (u == st.root() ? 1 : 2);
      if (!seg.host.storage()->released()) r.host_bytes += size_of(seg.host);
      const Tensor g = seg.host.grad();
      if (g.defined()) r.host_bytes += size_of(g);
    }
  }
  return r;
}

int64_t ZeroOffloadReport::step_io_formula(int64_t state_bytes_per_element) const {
  int64_t bytes = 0;
  if (param_copies_on_file(optimizer, params)) bytes += shard_bytes;
  if (optimizer == OffloadTier::file) bytes += shard_elements * state_bytes_per_element;
  return bytes;
}

int64_t ZeroOffloadReport::gather_read_formula(int accum, bool after_step) const {
  return accum * gathered_shard_bytes - (after_step ? handoff_bytes : 0);
}

std::string ZeroOffloadReport::str() const {
  auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
  std::string s = fmt::format("offload optimizer={} params={}: host {:.1f} MiB", offload_tier_name(optimizer),
                              offload_tier_name(params), mib(host_bytes));
  if (!file.empty()) {
    s += fmt::format(", file {:.1f} MiB ({}), read {:.1f} MiB, written {:.1f} MiB", mib(file_bytes),
                     direct_io ? "O_DIRECT" : "buffered", mib(read_bytes), mib(written_bytes));
    s += fmt::format(", window peak {:.1f} MiB", mib(window_peak_bytes));
  }
  s += fmt::format(", device->host {:.1f} MiB, host->device {:.1f} MiB", mib(to_host_bytes),
                   mib(to_device_bytes));
  return s;
}

}  // namespace tessera::parallel
