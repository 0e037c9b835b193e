// The threads backend's shared state (threads.h): the World of one run_threads call, one
// GroupState per communicator with its members' slots, arrival counters and barriers, and
// point-to-point mailboxes. Private to parallel/comm: threads.cc (workers, ThreadsComm,
// run_threads) and threads_collectives.cc (the collectives over the slots) include it.
//
//   run_all_reduce(*group, me, tensor, ReduceOp::sum);   // on member me's worker thread
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/comm/communicator.h"
#include "tensor/error.h"

namespace tessera::parallel::threads_internal {

// How it works. Every group (the world and each split) has a GroupState shared by its
// members: one Slot per member where it publishes its buffers and arguments, one arrival
// counter per member, and one mutex + condition variable. A collective is
//   entry barrier -> every member checks that all members agree (op, dtype, sizes) ->
//   direct copies / reductions out of peers' buffers -> exit barrier,
// so no member returns (and frees or reuses its buffer) while a peer may still read it. Only
// the entry barrier can fail (peer failure, peer exit, timeout): once every member is past
// it, the rest is plain memory work that cannot block. A member abandoning an entry barrier
// marks the group broken under the group mutex; arrivals refuse a broken group, so a barrier
// is either passed by all members or by none.

using Clock = std::chrono::steady_clock;

// Thrown when the cause is another rank's failure, so run_threads can rethrow the root cause.
class PeerFailure : public Error {
 public:
  using Error::Error;
};

[[noreturn]] inline void raise(const std::string& message, bool by_peer) {
  if (by_peer) throw PeerFailure(message);
  throw Error(message);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins before sleeping: catches peers arriving within microseconds without taking the core
// from them for long when ranks outnumber cores.
constexpr int kSpins = 256;

enum class OpKind : uint8_t {
  barrier, split, all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, send, recv
};

inline const char* op_name(OpKind op) {
  static constexpr const char* kNames[] = {"barrier",    "split",          "all_reduce",
                                           "all_gather", "reduce_scatter", "broadcast",
                                           "all_to_all", "send",           "recv"};
  return kNames[static_cast<int>(op)];
}

// Element range of block b when `count` elements split into n blocks of whole cache lines.
inline std::pair<int64_t, int64_t> block_range(int64_t count, int n, int b, int64_t esize) {
  const int64_t align = std::max<int64_t>(1, 64 / esize);
  const int64_t per = ((count + n - 1) / n + align - 1) / align * align;
  const int64_t lo = std::min(count, b * per);
  return {lo, std::min(count, lo + per)};
}

inline void copy_bytes(char* dst, const char* src, int64_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, static_cast<size_t>(bytes));
}

inline int64_t prefix(const int64_t* counts, int upto) {
  return std::accumulate(counts, counts + upto, int64_t{0});
}

// ---- shared state --------------------------------------------------------------------

struct GroupState;

struct World {
  World(int n, double timeout) : n(n), timeout_seconds(timeout), exited(new std::atomic<bool>[n]) {
    for (int r = 0; r < n; ++r) exited[r].store(false);
  }
  const int n;
  const double timeout_seconds;
  std::atomic<bool> failed{false};
  int failed_rank = -1;  // written once, before `failed` turns true
  std::string failed_message;
  // fn returned and every operation the rank queued has finished: it will never arrive again.
  std::unique_ptr<std::atomic<bool>[]> exited;

  std::mutex mu;
  std::vector<std::weak_ptr<GroupState>> groups;

  void add_group(const std::shared_ptr<GroupState>& g) {
    std::lock_guard<std::mutex> lock(mu);
    std::erase_if(groups, [](const std::weak_ptr<GroupState>& w) { return w.expired(); });
    groups.push_back(g);
  }
  void fail(int rank, const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failed.load()) return;
      failed_rank = rank;
      failed_message = message;
      failed.store(true);
    }
    wake_all();
  }
  void mark_exited(int rank) {
    exited[rank].store(true);
    wake_all();
  }
  void wake_all();
};

struct Message {
  DType dtype = DType::f32;
  int64_t numel = 0;
  std::unique_ptr<char[]> data;
};

// A receive posted before its message arrived; the sender copies straight into `buffer`.
struct PostedRecv {
  Tensor buffer;
  int src = 0, tag = 0;
  bool claimed = false;  // a sender is copying into buffer: it can no longer be abandoned
  bool done = false;
  std::string error;
  bool error_by_peer = false;
};

struct alignas(64) ArrivalCounter {
  std::atomic<int64_t> value{0};  // barriers this member has reached
};

// A member's collective and its arguments, as its peers see them.
struct Args {
  OpKind op = OpKind::barrier;
  DType dtype = DType::f32;
  ReduceOp rop = ReduceOp::sum;
  int root = 0, color = 0, key = 0;
  int64_t numel = 0;
  const char* in = nullptr;
  char* out = nullptr;
  const int64_t* counts = nullptr;  // all_gather, reduce_scatter; all_to_all: send counts
  const int64_t* recv_counts = nullptr;
};

// Peers read a slot only between the entry and exit barriers of a collective, so its owner
// may rewrite it for the next one.
struct alignas(64) Slot {
  Args args;
  int64_t barriers = 0;  // barriers entered so far; only the owner touches it
  std::shared_ptr<GroupState> new_group;  // split: set by the leader of each color
};

// Counts the waiters asleep on a group's condition variable (under its mutex), so arrivals
// notify only when someone sleeps.
struct Sleeping {
  explicit Sleeping(int& n) : n(n) { ++n; }
  ~Sleeping() { --n; }
  int& n;
};

struct GroupState {
  GroupState(std::shared_ptr<World> w, std::vector<int> m, std::string group_name)
      : world(std::move(w)), members(std::move(m)), name(std::move(group_name)),
        arrived(new ArrivalCounter[members.size()]), slots(members.size()) {
    is_world = static_cast<int>(members.size()) == world->n;
    for (size_t i = 0; i < members.size(); ++i) is_world = is_world && members[i] == int(i);
  }
  static std::shared_ptr<GroupState> create(const std::shared_ptr<World>& world,
                                            std::vector<int> members, const std::string& name) {
    auto g = std::make_shared<GroupState>(world, std::move(members), name);
    world->add_group(g);
    return g;
  }

  const std::shared_ptr<World> world;
  const std::vector<int> members;  // world rank of each member
  const std::string name;
  bool is_world = false;
  std::unique_ptr<ArrivalCounter[]> arrived;
  std::vector<Slot> slots;

  std::mutex mu;  // guards arrivals and everything below
  std::condition_variable cv;
  int sleepers = 0;
  std::string broken;  // why a barrier of this group was abandoned ("" while healthy)
  bool broken_by_peer = false;
  std::map<std::tuple<int, int, int>, std::deque<Message>> mailbox;  // (dst, src, tag)
  std::map<std::tuple<int, int, int>, std::deque<std::shared_ptr<PostedRecv>>> posted;

  int size() const { return static_cast<int>(members.size()); }
  const Args& args(int m) const { return slots[m].args; }

  // World ranks name threads; the member index is added for subgroups.
  std::string who(int m) const {
    if (is_world) return fmt::format("rank {}", m);
    return fmt::format("rank {} (member {} of '{}')", members[m], m, name);
  }
  std::string where(OpKind op) const { return fmt::format("{} on group '{}'", op_name(op), name); }
  std::string peer_failure(OpKind op) const {
    return fmt::format("{}: rank {} failed: {}", where(op), world->failed_rank,
                       world->failed_message);
  }

  Clock::time_point deadline() const {
    const double seconds = std::min(world->timeout_seconds, 1e8);  // no clock overflow
    return Clock::now() +
           std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }

  bool all_reached(int64_t k) const {
    for (int m = 0; m < size(); ++m) {
      if (arrived[m].value.load(std::memory_order_acquire) < k) return false;
    }
    return true;
  }

  // Why a member waiting at entry barrier k should give up, or "" (under mu).
  std::string abandon_reason(int64_t k, OpKind op, Clock::time_point deadline,
                             bool* by_peer) const {
    const bool failed = world->failed.load();
    *by_peer = broken.empty() ? failed : broken_by_peer;
    if (!broken.empty()) return broken;
    if (failed) return peer_failure(op);
    std::vector<std::string> missing;
    for (int m = 0; m < size(); ++m) {
      if (arrived[m].value.load() >= k) continue;
      if (world->exited[members[m]].load()) {
        return fmt::format("{} exited before joining {} on group '{}'", who(m), op_name(op), name);
      }
      missing.push_back(who(m));
    }
    if (Clock::now() < deadline) return "";
    return fmt::format("{}: timed out after {} s; {} never arrived", where(op),
                       world->timeout_seconds, fmt::join(missing, ", "));
  }

  // Entry barriers may fail (and then fail for every member); the barriers after one that
  // every member passed never do: nothing but memory work lies between them.
  void wait_barrier(int me, OpKind op, bool entry) {
    const int64_t k = ++slots[me].barriers;
    const Clock::time_point deadline = entry ? this->deadline() : Clock::time_point::max();
    {
      std::lock_guard<std::mutex> lock(mu);
      if (entry && !broken.empty()) {
        raise(fmt::format("{}: the group is unusable after an earlier failure: {}", where(op),
                          broken), broken_by_peer);
      }
      if (entry && world->failed.load()) throw PeerFailure(peer_failure(op));
      arrived[me].value.store(k, std::memory_order_release);
      if (sleepers > 0 && all_reached(k)) cv.notify_all();
    }
    for (int i = 0; i < kSpins; ++i) {
      if (all_reached(k)) return;
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mu);
    Sleeping sleeping(sleepers);
    while (!all_reached(k)) {
      if (!entry) {
        cv.wait(lock);
        continue;
      }
      bool by_peer = false;
      const std::string why = abandon_reason(k, op, deadline, &by_peer);
      if (!why.empty()) {
        if (broken.empty()) std::tie(broken, broken_by_peer) = std::make_pair(why, by_peer);
        cv.notify_all();
        raise(why, by_peer);
      }
      cv.wait_until(lock, deadline);
    }
  }
  void sync(int me, OpKind op) { wait_barrier(me, op, false); }

  // ---- point to point: sends never block; a receive completes when its message arrives ----

  // On the sender's worker: copies into a posted receive, or into the mailbox.
  void send(int me, int dst, int tag, const Tensor& t) {
    if (world->failed.load()) throw PeerFailure(peer_failure(OpKind::send));
    const auto key = std::make_tuple(dst, me, tag);
    const char* data = static_cast<const char*>(t.raw_data());
    std::unique_lock<std::mutex> lock(mu);
    if (auto r = claim_posted(key)) {
      lock.unlock();
      return finish_recv(*r, t.dtype(), t.numel(), data, me);
    }
    lock.unlock();  // copy outside the lock
    Message msg{t.dtype(), t.numel(), std::unique_ptr<char[]>(new char[t.nbytes()])};
    copy_bytes(msg.data.get(), data, t.nbytes());
    lock.lock();
    if (auto r = claim_posted(key)) {  // posted while we copied
      lock.unlock();
      return finish_recv(*r, msg.dtype, msg.numel, msg.data.get(), me);
    }
    mailbox[key].push_back(std::move(msg));
    if (sleepers > 0) cv.notify_all();
  }

  // On the receiver's worker: takes a waiting message, or posts the receive.
  void post_recv(int me, const std::shared_ptr<PostedRecv>& r) {
    if (world->failed.load()) throw PeerFailure(peer_failure(OpKind::recv));
    const auto key = std::make_tuple(me, r->src, r->tag);
    std::unique_lock<std::mutex> lock(mu);
    auto it = mailbox.find(key);
    if (it == mailbox.end()) return posted[key].push_back(r);
    Message msg = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) mailbox.erase(it);
    r->claimed = true;
    lock.unlock();
    finish_recv(*r, msg.dtype, msg.numel, msg.data.get(), r->src);
  }

  // Blocks until r completed; gives up when its sender can no longer send it.
  void wait_recv(int me, PostedRecv& r) {
    const Clock::time_point deadline = this->deadline();
    std::unique_lock<std::mutex> lock(mu);
    Sleeping sleeping(sleepers);
    while (!r.done) {
      if (r.claimed) {  // a sender is writing into the buffer right now
        cv.wait(lock);
        continue;
      }
      std::string why;
      r.error_by_peer = world->failed.load();
      if (r.error_by_peer) {
        why = peer_failure(OpKind::recv);
      } else if (world->exited[members[r.src]].load()) {
        why = fmt::format("recv on group '{}': {} exited before sending the message with tag {} "
                          "to {}", name, who(r.src), r.tag, who(me));
      } else if (Clock::now() >= deadline) {
        why = fmt::format("recv on group '{}': timed out after {} s waiting for a message from "
                          "{} with tag {}", name, world->timeout_seconds, who(r.src), r.tag);
      }
      if (!why.empty()) {
        std::erase_if(posted[std::make_tuple(me, r.src, r.tag)],
                      [&](const std::shared_ptr<PostedRecv>& p) { return p.get() == &r; });
        r.done = true;
        r.error = why;
        break;
      }
      cv.wait_until(lock, deadline);
    }
    if (!r.error.empty()) raise(r.error, r.error_by_peer);
  }

 private:
  std::shared_ptr<PostedRecv> claim_posted(const std::tuple<int, int, int>& key) {
    auto it = posted.find(key);
    if (it == posted.end()) return nullptr;
    std::shared_ptr<PostedRecv> r = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) posted.erase(it);
    r->claimed = true;
    return r;
  }

  void finish_recv(PostedRecv& r, DType dtype, int64_t numel, const char* data, int src) {
    std::string error;
    const Tensor& b = r.buffer;
    if (dtype != b.dtype() || numel != b.numel()) {
      error = fmt::format("recv on group '{}': the receiver expects {} {} elements from {} "
                          "(tag {}) but the message holds {} {}", name, b.numel(), b.dtype(),
                          who(src), r.tag, numel, dtype);
    } else {
      copy_bytes(static_cast<char*>(b.raw_data()), data, b.nbytes());
    }
    std::lock_guard<std::mutex> lock(mu);
    r.error = std::move(error);
    r.error_by_peer = false;
    r.done = true;
    cv.notify_all();
  }
};

inline void World::wake_all() {
  std::vector<std::shared_ptr<GroupState>> live;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& w : groups) {
      if (auto g = w.lock()) live.push_back(std::move(g));
    }
  }
  for (auto& g : live) {
    { std::lock_guard<std::mutex> lock(g->mu); }  // a waiter is either asleep or sees the flag
    g->cv.notify_all();
  }
}

// ---- the collectives (threads_collectives.cc), run on the member's worker -------------

// Publishes this member's arguments and passes the entry barrier with every other member;
// on a disagreement all members leave together and throw.
void begin(GroupState& g, int me, const Args& args);
void run_barrier(GroupState& g, int me);
// Member r reduces block r over every member's buffer (in member order) into its own
// buffer, then copies the other blocks from their owners.
void run_all_reduce(GroupState& g, int me, const Tensor& t, ReduceOp rop);
void run_all_gather(GroupState& g, int me, const Tensor& out, const Tensor& in,
                    const std::vector<int64_t>& counts);
void run_reduce_scatter(GroupState& g, int me, const Tensor& out, const Tensor& in, ReduceOp rop,
                        const std::vector<int64_t>& counts);
void run_broadcast(GroupState& g, int me, const Tensor& t, int root);
void run_all_to_all(GroupState& g, int me, const Tensor& out, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts);

}  // namespace tessera::parallel::threads_internal
