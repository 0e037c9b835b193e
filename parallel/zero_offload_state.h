// ZeroDataParallel's offload tiers, private to parallel/zero_offload*.cc: the state the tiers
// keep (State::Offload: the swap file, its read-ahead and write-behind window, the deferred
// updates of the file tier, the byte counts ZeroOffloadReport shows) and the few paging
// helpers zero_offload.cc defines that zero_offload_setup.cc uses too. Everything else of the
// paging stays in zero_offload.cc's anonymous namespace.
//
//   Offload& o = *st.offload;  // st: ZeroDataParallel::State, offload set up (offload_check)
//   Writes w = write_out(st, s, optimizer);  // segment s's pages on their way to the file
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "parallel/offload.h"
#include "parallel/zero.h"
#include "parallel/zero_state.h"

namespace tessera::parallel {
namespace zero_offload_internal {

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

}  // namespace zero_offload_internal

using zero_offload_internal::Paging;
using zero_offload_internal::Writes;

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

namespace zero_offload_internal {

using State = ZeroDataParallel::State;
using Offload = State::Offload;

// Defined in zero_offload.cc (what each does is said there).
int64_t size_of(const Tensor& t);
void wait_writes(Offload& o, std::vector<SwapFile::Request>& requests, std::vector<Tensor>& targets);
Writes write_out(State& st, int s, const optim::Optimizer* optimizer);
void release_pages(State& st, int s, const optim::Optimizer* optimizer);
int64_t shard_bytes(const State::Segment& seg);

}  // namespace zero_offload_internal

using zero_offload_internal::Offload;
using zero_offload_internal::release_pages;
using zero_offload_internal::shard_bytes;
using zero_offload_internal::size_of;
using zero_offload_internal::State;
using zero_offload_internal::wait_writes;
using zero_offload_internal::write_out;

}  // namespace tessera::parallel
