// ZeroDataParallel's offload tiers (ZeroOptions::offload, parallel/offload.h): the host
// copies of the shards the optimizer steps, their paging to and from the swap file, the
// gradients' trip to the host and the parameters' trip back.
//
// Paging is by storage: a host copy, or a state tensor the optimizer created (inside a
// HostTierScope, so on the host tier), is "paged out" when its bytes are written to the
// swap file and its storage released (StorageImpl::release: the tensor stays a valid handle
// the optimizer keeps in its state, and any op touching it throws), and "paged in" when the
// storage is reallocated (the host tier's cache hands back a buffer of the same size) and
// read back. Nothing else tracks residency, so it cannot go stale.
#include <fmt/format.h>

#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "autograd/checkpoint.h"
#include "parallel/placement.h"
#include "parallel/zero.h"
#include "parallel/zero_state.h"

namespace tessera::parallel {

struct ZeroDataParallel::State::Offload {
  bool param_file = false;  // the host copies of the parameters live in the swap file
  bool state_file = false;  // the optimizer's state lives in the swap file
  bool params = false;      // stage 3 without device shards
  std::unique_ptr<SwapFile> file;
  std::vector<SwapFile::Request> reads;  // per segment: a read ahead of its host copy
  std::vector<SwapFile::Request> setup_writes;  // construction's writes of the host copies
  // The optimizer's global index of each segment's host copy (bound at its first step).
  const optim::Optimizer* bound = nullptr;
  std::vector<int64_t> index;
  int64_t to_host = 0, to_device = 0;  // bytes copied between the device and the host
  int64_t state_host_bytes = 0;        // the optimizer state resident after the last step
};

namespace {

using State = ZeroDataParallel::State;
using Offload = State::Offload;

constexpr int64_t kKeysPerSegment = 64;  // record keys: segment * 64 + (0 param, 1.. state)

std::atomic<int64_t> g_swap_files{0};  // names the swap files of one process apart

void bind(State& st, const optim::Optimizer& optimizer) {
  Offload& o = *st.offload;
  if (o.bound == &optimizer) return;
  std::map<const TensorImpl*, int64_t> at;
  int64_t i = 0;
  for (const optim::ParamGroup& g : optimizer.param_groups()) {
    for (const Tensor& p : g.params) at[p.impl()] = i++;
  }
  std::vector<int64_t> index;
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) {
    auto it = at.find(st.segments[s].host.impl());
    TS_CHECK(it != at.end(),
             "{}: offload: the optimizer ({}) does not step segment {}'s host copy; build it on "
             "ZeroDataParallel::param_groups(), which returns the host copies when the "
             "optimizer is offloaded",
             kName, optimizer.kind(), s);
    index.push_back(it->second);
  }
  o.index = std::move(index);
  o.bound = &optimizer;
}

// The tensors of segment s that live in the swap file, with their record keys.
std::vector<std::pair<int64_t, Tensor>> pages(const State& st, int s,
                                              const optim::Optimizer* optimizer) {
  const Offload& o = *st.offload;
  std::vector<std::pair<int64_t, Tensor>> out;
  if (o.param_file) out.emplace_back(s * kKeysPerSegment, st.segments[s].host);
  if (o.state_file && optimizer != nullptr) {
    int64_t k = 1;
    for (const auto& [name, t] : optimizer->state(o.index[s])) {
      TS_CHECK(k < kKeysPerSegment, "{}: offload: more than {} state tensors per parameter",
               kName, kKeysPerSegment - 1);
      out.emplace_back(s * kKeysPerSegment + k++, t);
    }
  }
  return out;
}

void* bytes_of(const Tensor& t) { return t.storage()->data(); }
// Host-tier blocks hold whole 4096-byte pages (SwapFile may move them with O_DIRECT).
bool padded(const Tensor& t) { return t.storage()->allocator() == &host_tier_allocator(); }
int64_t size_of(const Tensor& t) { return t.storage()->nbytes(); }

// Reads the released pages of segment s back (reallocating them); returns the requests.
std::vector<SwapFile::Request> page_in(State& st, int s, const optim::Optimizer* optimizer) {
  Offload& o = *st.offload;
  std::vector<SwapFile::Request> out;
  for (auto& [key, t] : pages(st, s, optimizer)) {
    if (key % kKeysPerSegment == 0 && o.reads[s].pending()) {
      out.push_back(std::move(o.reads[s]));  // read ahead already
      continue;
    }
    if (!t.storage()->released()) continue;
    t.storage()->reallocate();
    out.push_back(o.file->read(key, bytes_of(t), size_of(t), padded(t)));
  }
  return out;
}

// Waits for every request, then throws the first one's error (none is left in flight over
// a buffer its owner may release).
void wait_all(std::vector<SwapFile::Request>& requests) {
  std::exception_ptr first;
  for (SwapFile::Request& r : requests) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  requests.clear();
  if (first) std::rethrow_exception(first);
}

// Waits for a read ahead of segment s's parameters still in flight (its buffer is about to be
// written, released or overwritten); a failed one leaves the page released (read again later).
void settle_read(State& st, int s) {
  Offload& o = *st.offload;
  if (!o.reads[s].pending()) return;
  try {
    o.reads[s].wait();
  } catch (const Error&) {
    st.segments[s].host.storage()->release();
  }
}

// Writes segment s's resident pages; release() them once the requests are done.
std::vector<SwapFile::Request> write_out(State& st, int s, const optim::Optimizer* optimizer) {
  settle_read(st, s);
  std::vector<SwapFile::Request> out;
  for (auto& [key, t] : pages(st, s, optimizer)) {
    if (!t.storage()->released()) out.push_back(st.offload->file->write(key, bytes_of(t), size_of(t), padded(t)));
  }
  return out;
}

void release_pages(State& st, int s, const optim::Optimizer* optimizer) {
  settle_read(st, s);
  for (auto& [key, t] : pages(st, s, optimizer)) t.storage()->release();
}

// Waits for page_in's requests; if one fails, segment s's pages are released (what was read
// is garbage, and a later page-in reads it again) before the error goes on.
void wait_pages(State& st, int s, const optim::Optimizer* optimizer,
                std::vector<SwapFile::Request>& reads) {
  try {
    wait_all(reads);
  } catch (...) {
    for (auto& [key, t] : pages(st, s, optimizer)) t.storage()->release();
    throw;
  }
}


int64_t shard_bytes(const State::Segment& seg) { return seg.shard_numel * dtype_size(seg.dtype); }

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
  for (auto& w : write_out(st, s, nullptr)) o.setup_writes.push_back(std::move(w));
}

void offload_finish_setup(State& st) {
  Offload& o = *st.offload;
  wait_all(o.setup_writes);
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) release_pages(st, s, nullptr);
}

void offload_shard_in(State& st, int s) {
  Offload& o = *st.offload;
  if (!o.params) return;  // the device keeps its shard
  State::Segment& seg = st.segments[s];
  if (o.param_file) {
    std::vector<SwapFile::Request> reads = page_in(st, s, nullptr);
    wait_pages(st, s, nullptr, reads);
  }
  seg.shard.storage()->reallocate();  // tagged by the caller (gathered)
  NoGradGuard no_grad;
  seg.shard.copy_(seg.host);
  o.to_device += shard_bytes(seg);
  if (o.param_file) release_pages(st, s, nullptr);  // clean: the file holds these bytes
}

void offload_shard_out(State& st, int s) {
  if (st.offload->params) st.segments[s].shard.storage()->release();
}

void offload_read_ahead(State& st, int u, bool forward) {
  Offload& o = *st.offload;
  if (!o.params || !o.param_file) return;
  // A recomputed forward inside backward (activation checkpointing) is followed by that
  // unit's backward, not by the next units' forward: nothing to read ahead.
  if (forward && autograd::recomputing()) return;
  // The two units gathered after u: forward, the root, then 0, 1, ...; backward, down to 0.
  std::vector<int> next;
  int at = u;
  for (int k = 0; k < 2; ++k) {
    at = forward ? (at == st.root() ? 0 : at + 1) : at - 1;
    if (at < 0 || at >= st.root()) break;
    next.push_back(at);
  }
  for (int v : next) {
    if (st.units[v].gather != State::Gather::released) continue;
    for (int s : st.units[v].segments) {
      const Tensor& h = st.segments[s].host;
      if (o.reads[s].pending() || !h.storage()->released()) continue;
      h.storage()->reallocate();
      o.reads[s] = o.file->read(s * kKeysPerSegment, bytes_of(h), size_of(h), padded(h));
    }
  }
}

void offload_take_grad(State& st, int s) {
  State::Segment& seg = st.segments[s];
  NoGradGuard no_grad;
  HostTierScope host;
  MemoryTagScope tag(MemoryTag::gradients);
  Tensor here = Tensor::empty({seg.shard_numel}, seg.dtype, kCPU);
  here.copy_(seg.reduced);
  st.offload->to_host += shard_bytes(seg);
  const Tensor grad = seg.host.grad();
  if (grad.defined()) grad.copy_(grad + here);  // the in-memory path's sum, on the host
  else seg.host.set_grad(here);
}

namespace {

// The file tier's update: a segment at a time (in the optimizer's order), its gradient alone
// attached, so step() updates it alone (an elementwise optimizer's update of one tensor is the
// same as in a bucket of many). The next segment's pages are read while this one updates,
// and a written segment is released once its writes are done: at most three are resident.
void update_segments(State& st, optim::Optimizer& optimizer, const std::vector<Tensor>& grads) {
  Offload& o = *st.offload;
  const std::vector<int> order = st.optimizer_order();
  const int n = static_cast<int>(order.size());
  std::vector<std::vector<SwapFile::Request>> reads(st.segments.size()), writes(st.segments.size());
  try {
    if (n > 0) reads[order[0]] = page_in(st, order[0], &optimizer);
    for (int j = 0; j < n; ++j) {
      const int s = order[j];
      State::Segment& seg = st.segments[s];
      wait_pages(st, s, &optimizer, reads[s]);
      if (j + 1 < n) reads[order[j + 1]] = page_in(st, order[j + 1], &optimizer);
      if (grads[s].defined()) {
        seg.host.set_grad(grads[s]);
        optimizer.step();
        seg.host.set_grad(Tensor());
      }
      if (!o.params) {  // the device's shard takes the update (stage 3 offloaded: none to take)
        seg.shard.copy_(seg.host);
        o.to_device += shard_bytes(seg);
      }
      writes[s] = write_out(st, s, &optimizer);
      if (j > 0) {
        wait_all(writes[order[j - 1]]);
        release_pages(st, order[j - 1], &optimizer);
      }
    }
    if (n > 0) {
      wait_all(writes[order[n - 1]]);
      release_pages(st, order[n - 1], &optimizer);
    }
  } catch (...) {
    // No request stays in flight over a page: every one is waited for (errors dropped, the
    // first one is on its way out). The pages stay resident; the file may be behind them.
    for (auto* list : {&reads, &writes}) {
      for (std::vector<SwapFile::Request>& requests : *list) {
        for (SwapFile::Request& r : requests) {
          try {
            r.wait();
          } catch (...) {
          }
        }
      }
    }
    throw;
  }
}

void count_state_bytes(State& st, const optim::Optimizer& optimizer) {
  Offload& o = *st.offload;
  o.state_host_bytes = 0;
  for (size_t s = 0; s < st.segments.size(); ++s) {
    for (const auto& [name, t] : optimizer.state(o.index[s])) {
      if (!t.storage()->released()) o.state_host_bytes += size_of(t);
    }
  }
}

}  // namespace

void offload_step(State& st, optim::Optimizer& optimizer) {
  Offload& o = *st.offload;
  bind(st, optimizer);
  const int n = static_cast<int>(st.segments.size());
  NoGradGuard no_grad;
  HostTierScope host;  // the state the optimizer creates, and its temporaries
  MemoryTagScope tag(MemoryTag::optimizer_state);
  if (!o.file) {  // everything resident: one step, as in memory
    optimizer.step();
    for (int s = 0; s < n && !o.params; ++s) {
      st.segments[s].shard.copy_(st.segments[s].host);
      o.to_device += shard_bytes(st.segments[s]);
    }
  } else {
    // The gradients leave the host copies while the segments update one at a time, and come
    // back after (as in memory, a step leaves them).
    std::vector<Tensor> grads(n);
    for (int s = 0; s < n; ++s) {
      grads[s] = st.segments[s].host.grad();
      st.segments[s].host.set_grad(Tensor());
    }
    struct Restore {
      State& st;
      const std::vector<Tensor>& grads;
      ~Restore() {
        for (size_t s = 0; s < grads.size(); ++s) st.segments[s].host.set_grad(grads[s]);
      }
    } restore{st, grads};
    update_segments(st, optimizer, grads);
  }
  count_state_bytes(st, optimizer);
}

void offload_set_shard(State& st, int s, const Tensor& values) {
  Offload& o = *st.offload;
  State::Segment& seg = st.segments[s];
  NoGradGuard no_grad;
  if (o.param_file) {
    settle_read(st, s);
    seg.host.storage()->reallocate();  // overwritten whole: nothing to read
  }
  seg.host.copy_(values);
  o.to_host += shard_bytes(seg);
  if (!o.params && !same_view(values, seg.shard)) seg.shard.copy_(values);
  if (o.param_file) {
    std::vector<SwapFile::Request> w = write_out(st, s, nullptr);
    wait_all(w);
    release_pages(st, s, nullptr);
  }
}

void offload_page_all(State& st, const optim::Optimizer* optimizer, bool in) {
  Offload& o = *st.offload;
  if (!o.file) return;
  if (optimizer != nullptr) bind(st, *optimizer);
  const int n = static_cast<int>(st.segments.size());
  if (in) {
    std::vector<std::vector<SwapFile::Request>> reads(n);
    for (int s = 0; s < n; ++s) reads[s] = page_in(st, s, optimizer);
    std::exception_ptr first;
    for (int s = 0; s < n; ++s) {
      try {
        wait_pages(st, s, optimizer, reads[s]);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    return;
  }
  std::vector<SwapFile::Request> writes;
  for (int s = 0; s < n; ++s) {
    for (auto& r : write_out(st, s, optimizer)) writes.push_back(std::move(r));
  }
  wait_all(writes);
  for (int s = 0; s < n; ++s) release_pages(st, s, optimizer);
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
  }
  r.to_host_bytes = o.to_host;
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

int64_t ZeroOffloadReport::gather_read_formula() const { return gathered_shard_bytes; }

std::string ZeroOffloadReport::str() const {
  auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
  std::string s = fmt::format("offload optimizer={} params={}: host {:.1f} MiB", offload_tier_name(optimizer),
                              offload_tier_name(params), mib(host_bytes));
  if (!file.empty()) {
    s += fmt::format(", file {:.1f} MiB ({}), read {:.1f} MiB, written {:.1f} MiB", mib(file_bytes),
                     direct_io ? "O_DIRECT" : "buffered", mib(read_bytes), mib(written_bytes));
  }
  s += fmt::format(", device->host {:.1f} MiB, host->device {:.1f} MiB", mib(to_host_bytes),
                   mib(to_device_bytes));
  return s;
}

}  // namespace tessera::parallel
