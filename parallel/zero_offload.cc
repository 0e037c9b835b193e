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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "autograd/checkpoint.h"
#include "tensor/autocast.h"
#include "tensor/host_pinning.h"
#include "parallel/placement.h"
#include "parallel/zero.h"
#include "parallel/zero_state.h"

namespace tessera::parallel {

// Pages of one segment on their way to or from the swap file, outside the update's own two
// (OffloadOptions::window): the tensors are held so their buffers outlive the requests.
struct Paging {
  std::vector<SwapFile::Request> requests;
  std::vector<Tensor> targets;  // writes: the page each request writes
  std::vector<Tensor> pages;    // released once the requests are done
  int64_t bytes = 0;
  bool empty() const { return requests.empty() && pages.empty(); }
};

// Writes of pages, a request per page.
struct Writes {
  std::vector<SwapFile::Request> requests;
  std::vector<Tensor> targets;
};

struct ZeroDataParallel::State::Offload {
  bool param_file = false;  // the host copies of the parameters live in the swap file
  bool state_file = false;  // the optimizer's state lives in the swap file
  bool params = false;      // stage 3 without device shards
  std::vector<SwapFile::Request> reads;  // per segment: a read ahead of its host copy
  Writes setup_writes;  // construction's writes of the host copies
  // The window (OffloadOptions::window): per segment, its pages read ahead for the step, and
  // an update's writes still in flight (`written`: those segments, oldest first).
  int64_t window = 0;
  std::vector<Paging> ahead, writing;
  std::deque<int> written;
  int64_t window_used = 0;  // ahead and writing: at most window - handoff_bytes, but one segment
  int64_t window_peak = 0;  // of window_used + handed_bytes
  // The segments in forward order (the updates' order; order[next_ahead] is the next to read
  // ahead), and each segment's pages as the last update left them (the optimizer's state
  // tensors then).
  std::vector<int> order;
  size_t next_ahead = 0;
  std::vector<std::vector<std::pair<int64_t, Tensor>>> known;
  // The file tier's update, segment by segment: due[s] while segment s's is still to run,
  // with the gradient the step took (grads[s]) and the learning rates it saw (lrs, per
  // group), on `optimizer`; update_reads[s]: its pages being read. At stage 3 (`lazy`) the
  // step only takes these and each update runs at its unit's next gather, on the caller's
  // thread, so the swap file's reads and writes for the update overlap the forward's
  // compute; other stages run them all in step().
  bool lazy = false;
  std::vector<char> due;
  std::vector<Tensor> grads;
  std::vector<double> lrs;
  optim::Optimizer* optimizer = nullptr;
  std::vector<std::vector<SwapFile::Request>> update_reads;
  // Stage 3 with the parameters on the file: an update leaves its parameter page resident
  // for the gather that follows it, which reads nothing (handed[s]: its bytes until then).
  std::vector<int64_t> handed;
  int64_t handed_bytes = 0;   // their sum now
  int64_t handoff_bytes = 0;  // every segment's page: the reads a step's first forward saves
  int64_t largest_pages = 0;  // the most bytes one segment's pages have held
  void note_peak() { window_peak = std::max(window_peak, window_used + handed_bytes); }
  // The optimizer's global index of each segment's host copy (bound at its first step).
  const optim::Optimizer* bound = nullptr;
  std::vector<int64_t> index;
  int64_t to_host = 0, to_device = 0;  // bytes copied between the device and the host
  // The optimizer state resident after the last step() (deferred updates and pages read
  // ahead change it after).
  int64_t state_host_bytes = 0;
  double update_seconds = 0, gather_wait_seconds = 0;  // ZeroOffloadReport's
  // Pages whose last write failed: they stay resident (nothing releases them) until a
  // later write of them succeeds.
  std::set<const StorageImpl*> dirty;
  // Per segment: its gradient's copy from the device in flight (the destination held until
  // it is waited for; wait null: none).
  struct GradCopy {
    Tensor dst;
    std::function<void()> wait;
  };
  std::vector<GradCopy> grad_copies;
  std::unique_ptr<SwapFile> file;  // (the destructor waits for every request first)

  ~Offload() {  // no request outlives the buffers it moves (errors have nowhere to go now)
    auto quiet = [](std::vector<SwapFile::Request>& requests) {
      for (SwapFile::Request& r : requests) {
        try {
          r.wait();
        } catch (...) {
        }
      }
    };
    for (GradCopy& copy : grad_copies) {
      try {
        if (copy.wait) copy.wait();
      } catch (...) {
      }
    }
    quiet(reads);
    quiet(setup_writes.requests);
    for (auto& requests : update_reads) quiet(requests);
    for (auto* list : {&ahead, &writing}) {
      for (Paging& p : *list) quiet(p.requests);
    }
  }
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

// Releases page t unless its last write failed (then only the page holds its bytes).
void release_page(Offload& o, const Tensor& t) {
  if (o.dirty.count(t.storage().get()) == 0) t.storage()->release();
}

// Waits for every write; a page whose write failed is marked dirty, one written is not; then
// throws the first error.
void wait_writes(Offload& o, std::vector<SwapFile::Request>& requests, std::vector<Tensor>& targets) {
  std::exception_ptr first;
  for (size_t i = 0; i < requests.size(); ++i) {
    const StorageImpl* page = targets[i].storage().get();
    try {
      requests[i].wait();
      o.dirty.erase(page);
    } catch (...) {
      o.dirty.insert(page);
      if (!first) first = std::current_exception();
    }
  }
  requests.clear();
  targets.clear();
  if (first) std::rethrow_exception(first);
}

// Segment s's writes from its last update, once done: its pages released (the file holds
// them now). A failed write throws, its page left resident and dirty.
void finish_writes(State& st, int s) {
  Offload& o = *st.offload;
  if (o.writing[s].empty()) return;
  Paging w = std::move(o.writing[s]);
  o.writing[s] = Paging{};
  o.window_used -= w.bytes;
  std::erase(o.written, s);
  for (const SwapFile::Request& r : w.requests) o.file->hurry(r);
  std::exception_ptr error;
  try {
    wait_writes(o, w.requests, w.targets);
  } catch (...) {
    error = std::current_exception();
  }
  for (const Tensor& t : w.pages) release_page(o, t);
  if (error) std::rethrow_exception(error);
}

// Releases the pages of every segment whose writes are done, without waiting.
void reap(State& st) {
  Offload& o = *st.offload;
  std::vector<int> done;
  for (int s : o.written) {
    bool all = true;
    for (const SwapFile::Request& r : o.writing[s].requests) all = all && r.done();
    if (all) done.push_back(s);
  }
  for (int s : done) finish_writes(st, s);
}

// Whether `bytes` more fit the window; `block`: waits for the oldest writes until they do.
bool make_room(State& st, int64_t bytes, bool block) {
  Offload& o = *st.offload;
  reap(st);
  while (block && o.window_used + bytes > o.window && !o.written.empty()) {
    finish_writes(st, o.written.front());
  }
  return o.window_used + bytes <= o.window;
}

// Segment s's parameter page, left by its update for the next gather, is that no more (the
// gather took it, or something else reads, releases or overwrites it).
void hand_over(State& st, int s) {
  Offload& o = *st.offload;
  o.handed_bytes -= o.handed[s];
  o.handed[s] = 0;
}

// Segment s's pages read ahead for the step: their requests (to wait for), off the window,
// hurried (an update takes them when it is about to run, or the one before it is).
std::vector<SwapFile::Request> take_ahead(State& st, int s) {
  Offload& o = *st.offload;
  Paging a = std::move(o.ahead[s]);
  o.ahead[s] = Paging{};
  o.window_used -= a.bytes;
  for (const SwapFile::Request& r : a.requests) o.file->hurry(r);
  return std::move(a.requests);
}

// Reads the released pages of segment s back (reallocating them); returns the requests. A
// page still being written is released once written and read like any other, so the reads
// are the same whatever the timing; pages read ahead are handed over.
std::vector<SwapFile::Request> page_in(State& st, int s, const optim::Optimizer* optimizer) {
  Offload& o = *st.offload;
  finish_writes(st, s);
  hand_over(st, s);
  // (A gather's, without the optimizer, leaves the state read ahead for the update.)
  std::vector<SwapFile::Request> out;
  std::vector<Tensor> fresh;  // the pages reallocated here (or for the reads ahead taken)
  if (optimizer != nullptr) {
    fresh = o.ahead[s].pages;
    out = take_ahead(st, s);
  }
  try {
    for (auto& [key, t] : pages(st, s, optimizer)) {
      if (key % kKeysPerSegment == 0 && o.reads[s].pending()) {
        out.push_back(std::move(o.reads[s]));  // read ahead already
        continue;
      }
      if (!t.storage()->released()) continue;
      t.storage()->reallocate();
      fresh.push_back(t);
      out.push_back(o.file->read(key, bytes_of(t), size_of(t), padded(t)));
    }
  } catch (...) {  // nothing left in flight over a page, none left looking read
    for (SwapFile::Request& r : out) {
      try {
        r.wait();
      } catch (...) {
      }
    }
    for (const Tensor& t : fresh) t.storage()->release();
    throw;
  }
  return out;
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
Writes write_out(State& st, int s, const optim::Optimizer* optimizer) {
  settle_read(st, s);
  // Two writes of one record in flight could land in either order.
  TS_CHECK(st.offload->writing[s].empty(), "{}: offload: segment {} is written again before its "
           "last writes were waited for", kName, s);
  Writes out;
  for (auto& [key, t] : pages(st, s, optimizer)) {
    if (t.storage()->released()) continue;
    out.requests.push_back(st.offload->file->write(key, bytes_of(t), size_of(t), padded(t)));
    out.targets.push_back(t);
  }
  return out;
}

void release_pages(State& st, int s, const optim::Optimizer* optimizer) {
  finish_writes(st, s);
  settle_read(st, s);
  hand_over(st, s);
  for (auto& [key, t] : pages(st, s, optimizer)) release_page(*st.offload, t);
}

// Waits for page_in's requests; if one fails, segment s's pages are released (what was read
// is garbage, and a later page-in reads it again) before the error goes on.
void wait_pages(State& st, int s, const optim::Optimizer* optimizer,
                std::vector<SwapFile::Request>& reads) {
  try {
    wait_all(reads);
  } catch (...) {
    // (A dirty page read nothing: it was resident.)
    for (auto& [key, t] : pages(st, s, optimizer)) release_page(*st.offload, t);
    throw;
  }
}

// The segments' order in forward (the root, then the units): the step updates them so, and
// the next forward gathers the first ones while the last ones' writes drain.
std::vector<int> forward_order(const State& st) {
  std::vector<int> order(st.segments.size());
  for (size_t s = 0; s < order.size(); ++s) order[s] = static_cast<int>(s);
  auto rank = [&](int s) { return st.segments[s].unit == st.root() ? -1 : st.segments[s].unit; };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rank(a) < rank(b); });
  return order;
}

// During backward (at each unit's gather and as each segment's gradient arrives): the next
// step's pages read ahead, in forward order (the next update's), as far as the window takes
// them without waiting for writes, as the last update left them (before the first step
// there is nothing to read). The parameter pages stay out when the gathers read them.
void read_ahead_for_step(State& st) {
  Offload& o = *st.offload;
  if (!o.file || o.window <= 0) return;
  reap(st);
  // (The gathers read a parameter page when the parameters live in the file.)
  const bool gathered = o.params && o.param_file;
  auto wanted = [&](int64_t key, const Tensor& page) {
    return page.storage()->released() && !(gathered && key % kKeysPerSegment == 0);
  };
  while (o.next_ahead < o.order.size()) {
    const int t = o.order[o.next_ahead];
    // Its update still due, or its writes in flight: later.
    if (o.due[t] || !o.writing[t].empty()) return;
    int64_t bytes = 0;
    for (const auto& [key, page] : o.known[t]) {
      if (wanted(key, page)) bytes += size_of(page);
    }
    if (bytes > 0) {
      if (!make_room(st, bytes, /*block=*/false)) return;  // the window is full
      Paging& a = o.ahead[t];
      for (const auto& [key, page] : o.known[t]) {
        if (!wanted(key, page)) continue;
        page.storage()->reallocate();
        a.requests.push_back(o.file->read(key, bytes_of(page), size_of(page), padded(page), /*ahead=*/true));
        a.pages.push_back(page);
      }
      a.bytes += bytes;
      o.window_used += bytes;
      o.note_peak();
    }
    ++o.next_ahead;
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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

// The next segment after s in forward order whose update is due (-1: none).
int next_due(const State& st, int s) {
  const Offload& o = *st.offload;
  auto it = std::find(o.order.begin(), o.order.end(), s);
  for (++it; it != o.order.end(); ++it) {
    if (o.due[*it]) return *it;
  }
  return -1;
}

// The file tier's update of segment s, due since the last step: its pages in (read ahead,
// or read now), the step's gradient alone attached, so the optimizer updates it alone (an
// elementwise optimizer's update of one tensor is the same as in a bucket of many, in any
// order) at the step's learning rates, the device's shard refreshed (unless it has none),
// and its pages written behind within the window (OffloadOptions::window; 0: the previous
// segment's writes are waited for as this one's start, the last one's at once). The next
// due segment's pages are read while this one updates.
void update_one(State& st, int s) {
  Offload& o = *st.offload;
  optim::Optimizer& optimizer = *o.optimizer;
  State::Segment& seg = st.segments[s];
  const auto start = std::chrono::steady_clock::now();
  NoGradGuard no_grad;
  AutocastGuard f32(DType::f32);  // (it may run inside an autocast forward)
  HostTierScope host;  // the state the optimizer creates, and its temporaries
  MemoryTagScope tag(MemoryTag::optimizer_state);
  std::vector<SwapFile::Request> reads = std::move(o.update_reads[s]);
  o.update_reads[s].clear();
  for (SwapFile::Request& r : page_in(st, s, &optimizer)) reads.push_back(std::move(r));
  wait_pages(st, s, &optimizer, reads);
  const int next = next_due(st, s);
  if (next >= 0 && o.update_reads[next].empty()) o.update_reads[next] = page_in(st, next, &optimizer);
  {
    // Only this segment's gradient is attached (a backward since may have left others), at
    // the step's learning rates (a schedule may have set the next step's since).
    std::vector<std::pair<int, Tensor>> others;
    for (int t = 0; t < static_cast<int>(st.segments.size()); ++t) {
      const Tensor g = st.segments[t].host.grad();
      if (g.defined()) others.emplace_back(t, g), st.segments[t].host.set_grad(Tensor());
    }
    std::vector<double> now;
    for (const optim::ParamGroup& g : optimizer.param_groups()) now.push_back(g.lr);
    struct Restore {
      State& st;
      int s;
      optim::Optimizer& optimizer;
      const std::vector<std::pair<int, Tensor>>& others;
      const std::vector<double>& lrs;
      ~Restore() {  // (also when step() throws: grads[s] stays the update's, unattached)
        st.segments[s].host.set_grad(Tensor());
        for (size_t g = 0; g < lrs.size(); ++g) optimizer.set_group_lr(g, lrs[g]);
        for (const auto& [t, g] : others) st.segments[t].host.set_grad(g);
      }
    } restore{st, s, optimizer, others, now};
    for (size_t g = 0; g < o.lrs.size(); ++g) optimizer.set_group_lr(g, o.lrs[g]);
    seg.host.set_grad(o.grads[s]);
    optimizer.step();
  }
  o.grads[s] = Tensor();
  o.due[s] = 0;
  if (!o.params) {  // the device's shard takes the update (stage 3 offloaded: none to take)
    seg.shard.copy_(seg.host);
    o.to_device += shard_bytes(seg);
  }
  o.known[s] = pages(st, s, &optimizer);
  Writes writes = write_out(st, s, &optimizer);
  Paging w;
  for (const auto& [key, t] : o.known[s]) {
    if (t.storage()->released()) continue;
    if (key % kKeysPerSegment == 0 && o.lazy && o.params && o.param_file) {
      o.handed[s] = size_of(t);  // stays for the gather that follows (written all the same)
      o.handed_bytes += o.handed[s];
    } else {
      w.pages.push_back(t);
      w.bytes += size_of(t);
    }
  }
  w.requests = std::move(writes.requests);
  w.targets = std::move(writes.targets);
  o.largest_pages = std::max(o.largest_pages, w.bytes + o.handed[s]);
  const int64_t bytes = w.bytes;
  if (!w.empty()) {  // tracked at once: a throw below leaves no write unaccounted for
    o.window_used += bytes;
    o.writing[s] = std::move(w);
    o.written.push_back(s);
  }
  // Room for it: the oldest writes waited for until the window holds no more than this
  // segment's pages beyond its size.
  reap(st);
  while (o.window_used - (o.writing[s].empty() ? 0 : bytes) > o.window && !o.written.empty() &&
         o.written.front() != s) {
    finish_writes(st, o.written.front());
  }
  o.note_peak();
  if (o.window == 0 && next < 0) {
    while (!o.written.empty()) finish_writes(st, o.written.front());
  }
  o.update_seconds += seconds_since(start);
}

// Every due update, in forward order.
void complete(State& st) {
  Offload& o = *st.offload;
  if (!o.file) return;
  for (int s : o.order) {
    if (o.due[s]) update_one(st, s);
  }
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

void offload_shard_in(State& st, int s) {
  Offload& o = *st.offload;
  if (o.due[s]) update_one(st, s);  // stage 3: the last step's update of s runs now
  if (!o.params) return;  // the device keeps its shard
  State::Segment& seg = st.segments[s];
  if (o.param_file && o.handed[s] == 0) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<SwapFile::Request> reads = page_in(st, s, nullptr);
    wait_pages(st, s, nullptr, reads);
    o.gather_wait_seconds += seconds_since(start);
  }
  seg.shard.storage()->reallocate();  // tagged by the caller (gathered)
  NoGradGuard no_grad;
  seg.shard.copy_(seg.host);
  o.to_device += shard_bytes(seg);
  if (!o.param_file) return;
  if (o.handed[s] == 0) {
    release_pages(st, s, nullptr);  // clean: the file holds these bytes
    return;
  }
  // The page its update left: released with the update's other pages once written.
  hand_over(st, s);
  if (o.writing[s].empty()) {
    release_page(o, seg.host);
  } else {
    o.writing[s].pages.push_back(seg.host);
    o.writing[s].bytes += size_of(seg.host);
    o.window_used += size_of(seg.host);
  }
}

void offload_shard_out(State& st, int s) {
  if (st.offload->params) st.segments[s].shard.storage()->release();
}

void offload_read_ahead(State& st, int u, bool forward) {
  Offload& o = *st.offload;
  if (!forward) read_ahead_for_step(st);
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
  reap(st);
  for (int v : next) {
    if (st.units[v].gather != State::Gather::released) continue;
    for (int s : st.units[v].segments) {
      const Tensor& h = st.segments[s].host;
      if (o.due[s]) {  // its update's pages (the update reads its parameters)
        if (o.update_reads[s].empty()) o.update_reads[s] = page_in(st, s, o.optimizer);
        continue;
      }
      // (Still being written: the gather waits for the writes, then reads.)
      if (o.reads[s].pending() || !h.storage()->released() || !o.writing[s].empty()) continue;
      h.storage()->reallocate();
      o.reads[s] = o.file->read(s * kKeysPerSegment, bytes_of(h), size_of(h), padded(h));
    }
  }
}

namespace {

// Waits for segment s's gradient copy to the host, if one is in flight.
void settle_grad(State& st, int s) {
  Offload& o = *st.offload;
  if (!o.grad_copies[s].wait) return;
  const Offload::GradCopy copy = std::move(o.grad_copies[s]);
  o.grad_copies[s] = Offload::GradCopy{};
  copy.wait();
}

}  // namespace

void offload_settle_grads(State& st) {
  std::exception_ptr first;
  for (int s = 0; s < static_cast<int>(st.segments.size()); ++s) {
    try {
      settle_grad(st, s);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void offload_take_grad(State& st, int s) {
  State::Segment& seg = st.segments[s];
  Offload& o = *st.offload;
  NoGradGuard no_grad;
  HostTierScope host;
  MemoryTagScope tag(MemoryTag::gradients);
  Tensor here = Tensor::empty({seg.shard_numel}, seg.dtype, kCPU);
  settle_grad(st, s);
  // On a device whose backend copies asynchronously into the (pinned) host tier (CUDA: on
  // the communication stream), the copy goes on while backward computes; finish() waits.
  const Tensor& r = seg.reduced;
  if (!r.device().is_cpu() && r.is_contiguous() && r.dtype() == here.dtype() && r.numel() == here.numel()) {
    if (const AsyncToHost copy = async_to_host(static_cast<int>(r.device().type))) {
      // (Tracked at once, with its destination: waited for whatever happens next.)
      o.grad_copies[s].wait = copy(here.raw_data(), r.raw_data(), shard_bytes(seg), r.device().index,
                                   r.storage()->data());
      if (o.grad_copies[s].wait) o.grad_copies[s].dst = here;
    }
  }
  if (!o.grad_copies[s].wait) here.copy_(seg.reduced);
  o.to_host += shard_bytes(seg);
  const Tensor grad = seg.host.grad();
  if (grad.defined()) {  // the in-memory path's sum, on the host
    settle_grad(st, s);
    grad.copy_(grad + here);
  } else {
    seg.host.set_grad(here);
  }
  read_ahead_for_step(st);
}

namespace {

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
  offload_settle_grads(st);
  const int n = static_cast<int>(st.segments.size());
  NoGradGuard no_grad;
  if (!o.file) {  // everything resident: one step, as in memory
    bind(st, optimizer);
    const auto start = std::chrono::steady_clock::now();
    HostTierScope host;  // the state the optimizer creates, and its temporaries
    MemoryTagScope tag(MemoryTag::optimizer_state);
    optimizer.step();
    for (int s = 0; s < n && !o.params; ++s) {
      st.segments[s].shard.copy_(st.segments[s].host);
      o.to_device += shard_bytes(st.segments[s]);
    }
    o.update_seconds += seconds_since(start);
    count_state_bytes(st, optimizer);
    return;
  }
  // The step's gradients leave the host copies for the updates (stages 1-2 put them back
  // after, as in memory a step leaves them; at stage 3 the step drops them).
  std::vector<Tensor> grads(n);
  for (int s = 0; s < n; ++s) {
    grads[s] = st.segments[s].host.grad();
    st.segments[s].host.set_grad(Tensor());
  }
  // An update still due from the last step first (a unit no forward gathered), on the
  // optimizer and indices it was taken with.
  try {
    complete(st);
  } catch (...) {
    for (int s = 0; s < n; ++s) st.segments[s].host.set_grad(grads[s]);
    throw;
  }
  bind(st, optimizer);
  // (Not when an update throws: the ones not done stay due, with their gradients, for the
  // next step() to finish; putting them back would apply them twice.)
  struct Restore {
    State& st;
    const std::vector<Tensor>& grads;
    bool on = true;
    int exceptions = std::uncaught_exceptions();
    ~Restore() {
      if (std::uncaught_exceptions() > exceptions) return;
      for (size_t s = 0; s < grads.size() && on; ++s) st.segments[s].host.set_grad(grads[s]);
    }
  } restore{st, grads};
  o.grads = grads;
  for (int s = 0; s < n; ++s) o.due[s] = grads[s].defined() ? 1 : 0;
  o.lrs.clear();
  for (const optim::ParamGroup& g : optimizer.param_groups()) o.lrs.push_back(g.lr);
  o.optimizer = &optimizer;
  o.next_ahead = 0;
  if (o.lazy) {
    restore.on = false;
    // Each segment updates at its unit's next gather; the first one's pages start now.
    for (int s : o.order) {
      if (!o.due[s]) continue;
      if (o.update_reads[s].empty()) o.update_reads[s] = page_in(st, s, &optimizer);
      break;
    }
  } else {
    complete(st);
  }
  count_state_bytes(st, optimizer);
}

void offload_complete(State& st) { complete(st); }

void offload_set_shard(State& st, int s, const Tensor& values) {
  Offload& o = *st.offload;
  State::Segment& seg = st.segments[s];
  complete(st);  // (as in memory: the step's update, then the new values)
  NoGradGuard no_grad;
  if (o.param_file) {
    finish_writes(st, s);  // nothing in flight over the buffer about to be overwritten
    // The state read ahead goes back to the file (it holds those bytes: a page read ahead
    // was released, never dirty), read or failed.
    const std::vector<Tensor> read_ahead = o.ahead[s].pages;
    auto drop = [&] {
      for (const Tensor& t : read_ahead) {
        if (t.storage() != seg.host.storage()) t.storage()->release();
      }
    };
    std::vector<SwapFile::Request> ahead = take_ahead(st, s);
    try {
      wait_all(ahead);
    } catch (...) {
      drop();
      throw;
    }
    drop();
    settle_read(st, s);
    seg.host.storage()->reallocate();  // overwritten whole: nothing to read
  }
  seg.host.copy_(values);
  o.to_host += shard_bytes(seg);
  if (!o.params && !same_view(values, seg.shard)) seg.shard.copy_(values);
  if (o.param_file) {
    Writes w = write_out(st, s, nullptr);
    wait_writes(o, w.requests, w.targets);
    release_pages(st, s, nullptr);
  }
}

void offload_page_all(State& st, const optim::Optimizer* optimizer, bool in) {
  Offload& o = *st.offload;
  if (!o.file) return;
  complete(st);  // the state as the last step left it
  if (optimizer != nullptr) bind(st, *optimizer);
  const int n = static_cast<int>(st.segments.size());
  for (int s = 0; s < n && optimizer != nullptr; ++s) o.known[s] = pages(st, s, optimizer);
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
  for (int s = 0; s < n; ++s) {  // nothing in flight: written before, read ahead after
    finish_writes(st, s);
    std::vector<SwapFile::Request> ahead = take_ahead(st, s);
    wait_all(ahead);
  }
  Writes writes;
  for (int s = 0; s < n; ++s) {
    Writes w = write_out(st, s, optimizer);
    for (size_t i = 0; i < w.requests.size(); ++i) {
      writes.requests.push_back(std::move(w.requests[i]));
      writes.targets.push_back(w.targets[i]);
    }
  }
  wait_writes(o, writes.requests, writes.targets);  // (a failed page stays, dirty)
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
