#include "parallel/comm/threads.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <system_error>
#include <thread>
#include <tuple>

#include "kernels/cpu/parallel.h"
#include "parallel/comm/staging.h"
#include "parallel/comm/threads_reduce.h"
#include "tensor/error.h"

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

namespace tessera::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Thrown when the cause is another rank's failure, so run_threads can rethrow the root cause.
class PeerFailure : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void raise(const std::string& message, bool by_peer) {
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

const char* op_name(OpKind op) {
  static constexpr const char* kNames[] = {"barrier",    "split",          "all_reduce",
                                           "all_gather", "reduce_scatter", "broadcast",
                                           "all_to_all", "send",           "recv"};
  return kNames[static_cast<int>(op)];
}

// Element range of block b when `count` elements split into n blocks of whole cache lines.
std::pair<int64_t, int64_t> block_range(int64_t count, int n, int b, int64_t esize) {
  const int64_t align = std::max<int64_t>(1, 64 / esize);
  const int64_t per = ((count + n - 1) / n + align - 1) / align * align;
  const int64_t lo = std::min(count, b * per);
  return {lo, std::min(count, lo + per)};
}

void copy_bytes(char* dst, const char* src, int64_t bytes) {
  if (bytes > 0 && dst != src) std::memmove(dst, src, static_cast<size_t>(bytes));
}

int64_t prefix(const int64_t* counts, int upto) {
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

void World::wake_all() {
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

// ---- the collectives, run on the member's worker ----------------------------------------

// The first thing the members disagree on about their collective, or "". Every member
// computes the same answer from the same slots, so all of them throw or none does.
std::string disagreement(const GroupState& g, OpKind op) {
  const int n = g.size();
  std::string bad;
  auto differs = [&](const char* what, auto value) {
    for (int m = 1; m < n && bad.empty(); ++m) {
      if (value(g.args(m)) != value(g.args(0))) {
        bad = fmt::format("{}: members disagree on the {}: {} has {} but {} has {}", g.where(op),
                          what, g.who(0), value(g.args(0)), g.who(m), value(g.args(m)));
      }
    }
  };
  differs("collective", [](const Args& a) { return std::string_view(op_name(a.op)); });
  if (!bad.empty() || op == OpKind::barrier || op == OpKind::split) return bad;
  differs("dtype", [](const Args& a) { return a.dtype; });
  if (op == OpKind::all_reduce || op == OpKind::broadcast) {
    differs("element count", [](const Args& a) { return a.numel; });
  }
  if (op == OpKind::all_reduce || op == OpKind::reduce_scatter) {
    differs("reduce op", [](const Args& a) { return reduce_op_name(a.rop); });
  }
  if (op == OpKind::broadcast) differs("root", [](const Args& a) { return a.root; });
  if (op == OpKind::all_gather || op == OpKind::reduce_scatter) {
    differs("counts", [n](const Args& a) {
      return fmt::format("[{}]", fmt::join(a.counts, a.counts + n, ", "));
    });
  }
  for (int i = 0; i < n && bad.empty() && op == OpKind::all_to_all; ++i) {
    for (int j = 0; j < n && bad.empty(); ++j) {
      if (g.args(i).recv_counts[j] != g.args(j).counts[i]) {
        bad = fmt::format("{}: {} sends {} elements to {} but it expects {}", g.where(op),
                          g.who(j), g.args(j).counts[i], g.who(i), g.args(i).recv_counts[j]);
      }
    }
  }
  return bad;
}

// Publishes this member's arguments and passes the entry barrier with every other member;
// on a disagreement all members leave together and throw.
void begin(GroupState& g, int me, const Args& args) {
  g.slots[me].args = args;
  g.wait_barrier(me, args.op, true);
  const std::string bad = disagreement(g, args.op);
  if (bad.empty()) return;
  g.sync(me, args.op);
  throw Error(bad);
}

void run_barrier(GroupState& g, int me) {
  begin(g, me, {.op = OpKind::barrier});
  g.sync(me, OpKind::barrier);  // nobody rewrites its slot while a peer still checks it
}

// Member r reduces block r over every member's buffer (in member order) into its own
// buffer, then copies the other blocks from their owners.
void run_all_reduce(GroupState& g, int me, const Tensor& t, ReduceOp rop) {
  constexpr OpKind op = OpKind::all_reduce;
  char* buf = static_cast<char*>(t.raw_data());
  begin(g, me, {.op = op, .dtype = t.dtype(), .rop = rop, .numel = t.numel(), .out = buf});
  const int n = g.size();
  const int64_t es = dtype_size(t.dtype());
  if (t.numel() > 0) {
    const auto [lo, hi] = block_range(t.numel(), n, me, es);
    if (hi > lo) {
      std::vector<const char*> src(n);
      for (int m = 0; m < n; ++m) src[m] = g.args(m).out + lo * es;
      internal::reduce_into(t.dtype(), rop, buf + lo * es, src, hi - lo);
    }
    g.sync(me, op);
    for (int b = 0; b < n; ++b) {
      const auto [blo, bhi] = block_range(t.numel(), n, b, es);
      if (b != me) copy_bytes(buf + blo * es, g.args(b).out + blo * es, (bhi - blo) * es);
    }
  }
  g.sync(me, op);
}

void run_all_gather(GroupState& g, int me, const Tensor& out, const Tensor& in,
                    const std::vector<int64_t>& counts) {
  constexpr OpKind op = OpKind::all_gather;
  begin(g, me, {.op = op, .dtype = in.dtype(), .in = static_cast<const char*>(in.raw_data()),
                .counts = counts.data()});
  const int64_t es = dtype_size(in.dtype());
  char* dst = static_cast<char*>(out.raw_data());
  for (int m = 0; m < g.size(); ++m) {
    copy_bytes(dst + prefix(counts.data(), m) * es, g.args(m).in, counts[m] * es);
  }
  g.sync(me, op);
}

void run_reduce_scatter(GroupState& g, int me, const Tensor& out, const Tensor& in, ReduceOp rop,
                        const std::vector<int64_t>& counts) {
  constexpr OpKind op = OpKind::reduce_scatter;
  begin(g, me, {.op = op, .dtype = in.dtype(), .rop = rop,
                .in = static_cast<const char*>(in.raw_data()), .counts = counts.data()});
  if (counts[me] > 0) {
    const int64_t offset = prefix(counts.data(), me) * dtype_size(in.dtype());
    std::vector<const char*> src(g.size());
    for (int m = 0; m < g.size(); ++m) src[m] = g.args(m).in + offset;
    internal::reduce_into(in.dtype(), rop, static_cast<char*>(out.raw_data()), src, counts[me]);
  }
  g.sync(me, op);
}

void run_broadcast(GroupState& g, int me, const Tensor& t, int root) {
  constexpr OpKind op = OpKind::broadcast;
  char* buf = static_cast<char*>(t.raw_data());
  begin(g, me, {.op = op, .dtype = t.dtype(), .root = root, .numel = t.numel(), .out = buf});
  if (me != root) copy_bytes(buf, g.args(root).out, t.nbytes());
  g.sync(me, op);
}

void run_all_to_all(GroupState& g, int me, const Tensor& out, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& recv_counts) {
  constexpr OpKind op = OpKind::all_to_all;
  begin(g, me, {.op = op, .dtype = in.dtype(), .in = static_cast<const char*>(in.raw_data()),
                .counts = send_counts.data(), .recv_counts = recv_counts.data()});
  const int64_t es = dtype_size(in.dtype());
  char* dst = static_cast<char*>(out.raw_data());
  for (int j = 0; j < g.size(); ++j) {
    const char* src = g.args(j).in + prefix(g.args(j).counts, me) * es;
    copy_bytes(dst + prefix(recv_counts.data(), j) * es, src, recv_counts[j] * es);
  }
  g.sync(me, op);
}

// ---- workers -----------------------------------------------------------------------------

struct Task {
  std::function<void()> fn;
  std::atomic<bool> done{false};
  std::exception_ptr error;  // set before done
};

// One per (rank, communicator): runs its operations one at a time in submission order, so
// collectives pair up across ranks in program order.
class Worker {
 public:
  explicit Worker(std::string label) : label_(std::move(label)) {}
  ~Worker() { join(); }  // normally already joined by the rank's RankState

  std::shared_ptr<Task> submit(OpKind op, std::function<void()> fn) {
    auto task = std::make_shared<Task>();
    task->fn = std::move(fn);
    std::lock_guard<std::mutex> lock(mu_);
    TS_CHECK(!stopping_, "{} on {}: the communicator was used after its rank finished (after "
             "run_threads returned?)", op_name(op), label_);
    queue_.push_back(task);
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { loop(); });
      } catch (const std::system_error& e) {
        queue_.pop_back();
        fail("{} on {}: cannot start the communicator's worker thread: {}", op_name(op), label_,
             e.what());
      }
    }
    wake_.notify_one();
    return task;
  }

  void wait(const std::shared_ptr<Task>& task) {
    std::unique_lock<std::mutex> lock(mu_);
    // Next in line and the worker idle: run it here, saving two thread switches per
    // blocking call (order is kept: nothing else of this communicator runs meanwhile).
    if (!busy_ && !queue_.empty() && queue_.front() == task) run_front(lock);
    done_.wait(lock, [&] { return task->done.load(); });
    if (task->error) std::rethrow_exception(task->error);
  }

  // Lets the queue drain, then ends the thread.
  void request_stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    wake_.notify_all();
  }
  void join() {
    request_stop();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }
  bool finished() const { return finished_.load(); }

 private:
  // Runs the first queued task with the lock released (called with it held).
  void run_front(std::unique_lock<std::mutex>& lock) {
    std::shared_ptr<Task> task = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    try {
      task->fn();
    } catch (...) {
      task->error = std::current_exception();
    }
    task->fn = nullptr;  // release the buffers it held
    lock.lock();
    busy_ = false;
    task->done.store(true, std::memory_order_release);
    done_.notify_all();
    wake_.notify_one();
  }

  void loop() {
    cpu::set_num_threads(1);
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      wake_.wait(lock, [&] { return !busy_ && (!queue_.empty() || stopping_); });
      if (queue_.empty()) break;
      run_front(lock);
    }
    finished_.store(true);
  }

  const std::string label_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool busy_ = false;  // a task is running, here or on a waiter that took it
  bool stopping_ = false;
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

// The workers one rank started; joined when its fn returns, before it counts as exited.
struct RankState {
  std::mutex mu;
  std::vector<std::shared_ptr<Worker>> workers;

  std::shared_ptr<Worker> new_worker(std::string label) {
    auto w = std::make_shared<Worker>(std::move(label));
    std::lock_guard<std::mutex> lock(mu);
    std::erase_if(workers, [](const std::shared_ptr<Worker>& x) {
      if (!x->finished()) return false;
      x->join();  // its thread already returned: this does not block
      return true;
    });
    workers.push_back(w);
    return w;
  }

  // Loops because a queued split may create a communicator (and worker) while draining.
  void finish() {
    while (true) {
      std::vector<std::shared_ptr<Worker>> batch;
      {
        std::lock_guard<std::mutex> lock(mu);
        batch.swap(workers);
      }
      if (batch.empty()) return;
      for (auto& w : batch) w->join();
    }
  }
};

// A receive completes when its message arrives, which may be after its task (posting it)
// ran: the worker moves on meanwhile, so a recv_async posted before the matching send_async
// on the same communicator does not deadlock.
class ThreadsWork final : public Work {
 public:
  ThreadsWork(std::shared_ptr<Worker> worker, std::shared_ptr<Task> task,
              std::shared_ptr<GroupState> group = nullptr, int me = 0,
              std::shared_ptr<PostedRecv> recv = nullptr)
      : worker_(std::move(worker)), task_(std::move(task)), group_(std::move(group)), me_(me),
        recv_(std::move(recv)) {}
  void wait() override {
    worker_->wait(task_);
    if (recv_) group_->wait_recv(me_, *recv_);
  }
  bool is_completed() override {
    if (!task_->done.load(std::memory_order_acquire)) return false;
    if (!recv_) return true;
    std::lock_guard<std::mutex> lock(group_->mu);
    return recv_->done;
  }

 private:
  std::shared_ptr<Worker> worker_;
  std::shared_ptr<Task> task_;
  std::shared_ptr<GroupState> group_;  // receives only
  int me_;
  std::shared_ptr<PostedRecv> recv_;
};

class ThreadsComm final : public Communicator {
 public:
  ThreadsComm(int rank, std::shared_ptr<GroupState> group, std::shared_ptr<RankState> rank_state,
              const std::string& name)
      : Communicator(rank, group->size(), name), group_(std::move(group)),
        rank_state_(std::move(rank_state)),
        worker_(rank_state_->new_worker(fmt::format("group '{}' rank {}", name, rank))) {}
  ~ThreadsComm() override { worker_->request_stop(); }

  std::string_view backend() const override { return "threads"; }

 protected:
  std::shared_ptr<Communicator> do_split(int color, int key, const std::string& name) override {
    std::shared_ptr<Communicator> result;
    // Waited below, so capturing locals by reference is safe.
    submit(OpKind::split, [&] { result = run_split(color, key, name); })->wait();
    return result;
  }

  // Device tensors are staged through host copies (staging.h); each do_* below then calls
  // itself with the host buffers, so the CPU path is the only one that exchanges data.
  WorkHandle do_all_reduce(const Tensor& t, ReduceOp op) override {
    if (internal::off_host(t)) [[unlikely]] {
      const Tensor h = internal::host_copy(t);
      return internal::copy_back(do_all_reduce(h, op), t, h);
    }
    return submit(OpKind::all_reduce, [g = group_, me = rank(), t, op] {
      run_all_reduce(*g, me, t, op);
    });
  }

  WorkHandle do_all_gather(const Tensor& out, const Tensor& in,
                           const std::vector<int64_t>& counts) override {
    if (internal::off_host(out)) [[unlikely]] {
      const Tensor h = internal::host_buffer(out);
      return internal::copy_back(do_all_gather(h, internal::host_copy(in), counts), out, h);
    }
    return submit(OpKind::all_gather, [g = group_, me = rank(), out, in, counts] {
      run_all_gather(*g, me, out, in, counts);
    });
  }

  WorkHandle do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op,
                               const std::vector<int64_t>& counts) override {
    if (internal::off_host(out)) [[unlikely]] {
      const Tensor h = internal::host_buffer(out);
      return internal::copy_back(do_reduce_scatter(h, internal::host_copy(in), op, counts), out,
                                 h);
    }
    return submit(OpKind::reduce_scatter, [g = group_, me = rank(), out, in, op, counts] {
      run_reduce_scatter(*g, me, out, in, op, counts);
    });
  }

  WorkHandle do_broadcast(const Tensor& t, int root) override {
    if (internal::off_host(t)) [[unlikely]] {
      const bool root_here = rank() == root;  // the root's tensor is only read
      const Tensor h = root_here ? internal::host_copy(t) : internal::host_buffer(t);
      return internal::copy_back(do_broadcast(h, root), root_here ? Tensor() : t, h);
    }
    return submit(OpKind::broadcast,
                  [g = group_, me = rank(), t, root] { run_broadcast(*g, me, t, root); });
  }

  WorkHandle do_all_to_all(const Tensor& out, const Tensor& in,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts) override {
    if (internal::off_host(out)) [[unlikely]] {
      const Tensor h = internal::host_buffer(out);
      return internal::copy_back(
          do_all_to_all(h, internal::host_copy(in), send_counts, recv_counts), out, h);
    }
    const char* o = static_cast<const char*>(out.raw_data());
    const char* i = static_cast<const char*>(in.raw_data());
    // Peers read our input while we write our output, so they must not overlap.
    TS_CHECK(out.nbytes() == 0 || in.nbytes() == 0 || o + out.nbytes() <= i ||
                 i + in.nbytes() <= o,
             "all_to_all on group '{}': output and input overlap; the threads backend needs "
             "separate buffers", name());
    return submit(OpKind::all_to_all, [g = group_, me = rank(), out, in, send_counts,
                                       recv_counts] {
      run_all_to_all(*g, me, out, in, send_counts, recv_counts);
    });
  }

  WorkHandle do_send(const Tensor& t, int dst, int tag) override {
    if (internal::off_host(t)) [[unlikely]] return do_send(internal::host_copy(t), dst, tag);
    return submit(OpKind::send,
                  [g = group_, me = rank(), t, dst, tag] { g->send(me, dst, tag, t); });
  }

  WorkHandle do_recv(const Tensor& t, int src, int tag) override {
    if (internal::off_host(t)) [[unlikely]] {
      const Tensor h = internal::host_buffer(t);
      return internal::copy_back(do_recv(h, src, tag), t, h);
    }
    auto recv = std::make_shared<PostedRecv>();
    recv->buffer = t;
    recv->src = src;
    recv->tag = tag;
    auto task = worker_->submit(OpKind::recv,
                                [g = group_, me = rank(), recv] { g->post_recv(me, recv); });
    return std::make_shared<ThreadsWork>(worker_, std::move(task), group_, rank(), std::move(recv));
  }

  WorkHandle do_barrier() override {
    return submit(OpKind::barrier, [g = group_, me = rank()] { run_barrier(*g, me); });
  }

 private:
  WorkHandle submit(OpKind op, std::function<void()> fn) {
    return std::make_shared<ThreadsWork>(worker_, worker_->submit(op, std::move(fn)));
  }

  // Members publish (color, key); the first member of each color (by key, then rank) creates
  // the new group and the others pick it up from its slot.
  std::shared_ptr<Communicator> run_split(int color, int key, const std::string& name) {
    constexpr OpKind op = OpKind::split;
    GroupState& g = *group_;
    const int me = rank();
    begin(g, me, {.op = op, .color = color, .key = key});
    std::vector<int> peers;  // members of our color, by (key, rank)
    for (int m = 0; m < g.size(); ++m) {
      if (g.args(m).color == color) peers.push_back(m);
    }
    std::stable_sort(peers.begin(), peers.end(),
                     [&](int a, int b) { return g.args(a).key < g.args(b).key; });
    const int leader = peers.front();
    if (me == leader) {
      std::vector<int> world_ranks;
      for (int p : peers) world_ranks.push_back(g.members[p]);
      g.slots[me].new_group = GroupState::create(g.world, std::move(world_ranks), name);
    }
    g.sync(me, op);
    std::shared_ptr<GroupState> group = g.slots[leader].new_group;
    g.sync(me, op);
    g.slots[me].new_group.reset();  // everyone holds it now
    const auto new_rank = std::find(peers.begin(), peers.end(), me) - peers.begin();
    return std::make_shared<ThreadsComm>(static_cast<int>(new_rank), std::move(group),
                                         rank_state_, name);
  }

  std::shared_ptr<GroupState> group_;
  std::shared_ptr<RankState> rank_state_;
  std::shared_ptr<Worker> worker_;
};

}  // namespace

void run_threads(int n, const std::function<void(CommPtr world)>& fn, ThreadsOptions options) {
  TS_CHECK(n >= 1, "run_threads: need at least 1 rank, got {}", n);
  TS_CHECK(options.kernel_threads >= 0, "run_threads: kernel_threads must be >= 0, got {}",
           options.kernel_threads);
  TS_CHECK(options.timeout_seconds > 0, "run_threads: timeout_seconds must be > 0, got {}",
           options.timeout_seconds);
  const int kernel_threads =
      options.kernel_threads > 0
          ? options.kernel_threads
          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / n);
  auto world = std::make_shared<World>(n, options.timeout_seconds);
  std::vector<int> members(n);
  std::iota(members.begin(), members.end(), 0);
  auto group = GroupState::create(world, members, "world");

  std::vector<std::exception_ptr> errors(n);
  std::vector<char> root_cause(n, 0);
  auto rank_main = [&](int r) {
    cpu::set_num_threads(kernel_threads);
    auto rank_state = std::make_shared<RankState>();
    try {
      fn(std::make_shared<ThreadsComm>(r, group, rank_state, "world"));
    } catch (const PeerFailure&) {
      errors[r] = std::current_exception();
    } catch (const std::exception& e) {
      errors[r] = std::current_exception();
      root_cause[r] = 1;
      world->fail(r, e.what());
    } catch (...) {
      errors[r] = std::current_exception();
      root_cause[r] = 1;
      world->fail(r, "unknown exception");
    }
    rank_state->finish();
    world->mark_exited(r);
  };
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back(rank_main, r);
    } catch (const std::system_error& e) {
      // The ranks already running would wait for this one in their first collective: fail
      // them (as a rank that threw would), let them finish, and report why.
      const std::string why = fmt::format(
          "run_threads: cannot start the thread of rank {} of {}: {} (the system's limit on "
          "threads or memory?)",
          r, n, e.what());
      world->fail(r, why);
      for (int q = r; q < n; ++q) world->mark_exited(q);
      for (auto& t : threads) t.join();
      fail("{}", why);
    }
  }
  for (auto& t : threads) t.join();

  for (int r = 0; r < n; ++r) {
    if (errors[r] && root_cause[r]) std::rethrow_exception(errors[r]);
  }
  for (int r = 0; r < n; ++r) {
    if (errors[r]) std::rethrow_exception(errors[r]);
  }
}

}  // namespace tessera::parallel
