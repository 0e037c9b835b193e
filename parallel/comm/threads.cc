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
#include "parallel/comm/threads_group.h"
#include "tensor/error.h"

namespace tessera::parallel {
namespace {

using namespace threads_internal;  // NOLINT: this backend's own internals

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

  WorkHandle do_all_reduce(const Tensor& t, ReduceOp op) override {
    return submit(OpKind::all_reduce, [g = group_, me = rank(), t, op] {
      run_all_reduce(*g, me, t, op);
    });
  }

  WorkHandle do_all_gather(const Tensor& out, const Tensor& in,
                           const std::vector<int64_t>& counts) override {
    return submit(OpKind::all_gather, [g = group_, me = rank(), out, in, counts] {
      run_all_gather(*g, me, out, in, counts);
    });
  }

  WorkHandle do_reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op,
                               const std::vector<int64_t>& counts) override {
    return submit(OpKind::reduce_scatter, [g = group_, me = rank(), out, in, op, counts] {
      run_reduce_scatter(*g, me, out, in, op, counts);
    });
  }

  WorkHandle do_broadcast(const Tensor& t, int root) override {
    return submit(OpKind::broadcast,
                  [g = group_, me = rank(), t, root] { run_broadcast(*g, me, t, root); });
  }

  WorkHandle do_all_to_all(const Tensor& out, const Tensor& in,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts) override {
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
    return submit(OpKind::send,
                  [g = group_, me = rank(), t, dst, tag] { g->send(me, dst, tag, t); });
  }

  WorkHandle do_recv(const Tensor& t, int src, int tag) override {
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
