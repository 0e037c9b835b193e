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
#include <algorithm>
#include <chrono>
#include <exception>
#include <map>
#include <utility>
#include <vector>

#include "autograd/checkpoint.h"
#include "tensor/autocast.h"
#include "tensor/host_pinning.h"
#include "parallel/zero.h"
#include "parallel/zero_offload_state.h"
#include "parallel/zero_state.h"

namespace tessera::parallel {

namespace {

constexpr int64_t kKeysPerSegment = 64;  // record keys: segment * 64 + (0 param, 1.. state)

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

}  // namespace

// (zero_offload_setup.cc uses these too: declared in zero_offload_state.h.)
namespace zero_offload_internal {

int64_t size_of(const Tensor& t) { return t.storage()->nbytes(); }

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

int64_t shard_bytes(const State::Segment& seg) { return seg.shard_numel * dtype_size(seg.dtype); }

}  // namespace zero_offload_internal

namespace {

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

}  // namespace

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

}  // namespace tessera::parallel
