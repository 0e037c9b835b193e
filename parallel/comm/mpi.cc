#include "parallel/comm/mpi.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/comm/mpi_watchdog.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

std::atomic<int64_t> g_max_count{INT32_MAX};

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

class MpiComm;
using Requests = std::vector<MPI_Request>;

// ---- the work queue ----------------------------------------------------------------------
// A collective starts "deferred": wait() runs MPI's blocking form (the fast one), anything
// that needs it in flight earlier posts the nonblocking form. The process keeps at most one
// deferred work (the latest issued); issuing the next one posts it first, under g_issue_mu,
// so MPI sees every rank's calls in program order.

class MpiWork : public Work {
 public:
  explicit MpiWork(std::shared_ptr<const MpiComm> comm) : comm_(std::move(comm)) {}
  ~MpiWork() override;
  void wait() override;
  bool is_completed() override;

  // Posts the nonblocking form; the caller holds g_issue_mu and has taken this work out of the
  // deferred slot. An error is kept for wait() rather than thrown at whoever issued next.
  void post_now();

 protected:
  // Runs the MPI call(s): blocking when `requests` is null, else posts them into it.
  virtual void run(Requests* requests) = 0;
  // Post-processing once the call(s) completed (avg divide, f16 rounding).
  virtual void finish() {}
  // The nonblocking call's name, for errors that surface in MPI_Wait.
  virtual const char* posted_call() const = 0;
  // The collective ("all_reduce"), for the watchdog's message.
  virtual const char* op() const = 0;
  const MpiComm& comm() const { return *comm_; }

 private:
  enum class State { deferred, posted, done };
  void complete_locked();  // mu_ held: deferred -> blocking run, posted -> MPI_Wait; then finish

  std::shared_ptr<const MpiComm> comm_;
  std::mutex mu_;
  State state_ = State::deferred;
  Requests requests_;
  std::exception_ptr error_;
};

std::mutex g_issue_mu;
std::shared_ptr<MpiWork> g_deferred;  // guarded by g_issue_mu

// Posts the deferred work, if any (g_issue_mu held). Returns it so the caller releases it
// after unlocking: dropping the last handle of a posted work waits for it.
std::shared_ptr<MpiWork> post_deferred_locked() {
  std::shared_ptr<MpiWork> prev = std::move(g_deferred);
  g_deferred.reset();
  if (prev) prev->post_now();
  return prev;
}

// Sends whose copies are still in flight (see do_send). Reaped on every later call.
struct PendingSend {
  MPI_Request request;
  std::shared_ptr<char[]> data;  // shared by the chunks of one send
  std::string where;  // "group 'x' failed on rank r of n", for a late error
};
std::mutex g_send_mu;
std::vector<PendingSend> g_sends;  // guarded by g_send_mu
std::atomic<int> g_num_sends{0};

void reap_sends() {
  if (g_num_sends.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(g_send_mu);
  for (size_t i = 0; i < g_sends.size();) {
    int done = 0;
    MPI_Status status;
    const int rc = MPI_Test(&g_sends[i].request, &done, &status);
    if (rc != MPI_SUCCESS) {
      const std::string where = g_sends[i].where;
      g_sends.erase(g_sends.begin() + static_cast<ptrdiff_t>(i));
      g_num_sends.fetch_sub(1, std::memory_order_relaxed);
      fail("mpi: MPI_Isend (an earlier send) on {}: {}", where, mpi_error_string(rc));
    }
    if (!done) {
      ++i;
      continue;
    }
    g_sends.erase(g_sends.begin() + static_cast<ptrdiff_t>(i));
    g_num_sends.fetch_sub(1, std::memory_order_relaxed);
  }
}

// Registered with atexit by the first mpi_world() that initialised MPI.
void finalize_mpi() {
  if (mpi_finalized()) return;
  std::shared_ptr<MpiWork> last;
  {
    std::lock_guard<std::mutex> lock(g_issue_mu);
    last = std::move(g_deferred);
    g_deferred.reset();
  }
  try {
    if (last) last->wait();
  } catch (const std::exception&) {
    // Exiting: a failed last collective was never waited on; nobody is left to tell.
  }
  last.reset();
  internal::WatchedWait watched("MPI_Finalize (waiting for the other ranks to finish)");
  {
    std::lock_guard<std::mutex> lock(g_send_mu);
    for (PendingSend& s : g_sends) MPI_Wait(&s.request, MPI_STATUS_IGNORE);
    g_sends.clear();
  }
  MPI_Finalize();
}

// ---- types and conversions -----------------------------------------------------------------

// Bit-exact movement of each dtype.
MPI_Datatype move_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::f16:
    case DType::bf16: return MPI_UINT16_T;
    case DType::i32: return MPI_INT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::b8:
    case DType::u8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

// How a reduction runs: f16/bf16 widen to f32 (accumulate there, round once, as the threads
// backend does); bool uses logical or / and.
struct Reduction {
  MPI_Datatype type;
  MPI_Op op;
  bool widen;
  bool avg;
};

Reduction reduction_for(DType dt, ReduceOp op) {
  const bool widen = dt == DType::f16 || dt == DType::bf16;
  Reduction r{widen ? MPI_FLOAT : move_type(dt), MPI_SUM, widen, op == ReduceOp::avg};
  if (dt == DType::b8) {
    r.type = MPI_C_BOOL;
    r.op = op == ReduceOp::min ? MPI_LAND : MPI_LOR;
    return r;
  }
  if (op == ReduceOp::max) r.op = MPI_MAX;
  if (op == ReduceOp::min) r.op = MPI_MIN;
  return r;
}

// f16/bf16 buffers as f32 (MPI has no 16-bit float reductions).
Tensor widen(const Tensor& t) {
  NoGradGuard no_grad;
  return tessera::cast(t, DType::f32);
}

// Writes reduced values into dst: `sums` is the f32 buffer for f16/bf16 (rounded once here)
// or dst itself; avg divides by `divisor` first.
void store_reduced(const Tensor& sums, const Tensor& dst, int divisor) {
  NoGradGuard no_grad;
  Tensor v = sums;
  if (divisor != 1) v = tessera::div(v, tessera::scalar_like(divisor, v, "mpi avg"));
  if (!v.is_same(dst)) dst.copy_(v);
}
// Calls f(offset, count) over [0, total) in pieces MPI's int counts can hold (once for 0).
template <typename F>
void for_chunks(int64_t total, F&& f) {
  const int64_t max = g_max_count.load(std::memory_order_relaxed);
  int64_t offset = 0;
  do {
    const int64_t n = std::min(max, total - offset);
    f(offset, static_cast<int>(n));
    offset += n;
  } while (offset < total);
}

char* at(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.raw_data()) + elements * dtype_size(t.dtype());
}

// ---- the communicator ----------------------------------------------------------------------

class MpiComm final : public Communicator, public std::enable_shared_from_this<MpiComm> {
 public:
  MpiComm(MPI_Comm comm, int rank, int size, const std::string& name)
      : Communicator(rank, size, name), comm_(comm) {}
  ~MpiComm() override {
    if (!mpi_finalized()) MPI_Comm_free(&comm_);
  }
  std::string_view backend() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }

  void check(int code, const char* call) const {
    if (code != MPI_SUCCESS) [[unlikely]] {
      fail("mpi: {} on group '{}' failed on rank {} of {}: {}", call, name(), rank(), size(),
           mpi_error_string(code));
    }
  }

  // Wraps a new communicator handle (errors returned, not fatal).
  static std::shared_ptr<MpiComm> wrap(MPI_Comm comm, const std::string& name) {
    int rank = 0, size = 0;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    return std::make_shared<MpiComm>(comm, rank, size, name);
  }

  // True when every member has the same count. MPI counts are ints, and OpenMPI's algorithms
  // index the whole buffer with ints: throws naming `op` when the counts sum above that.
  bool equal_counts(const char* op, const std::vector<int64_t>& counts) const;

 protected:
  std::shared_ptr<Communicator> do_split(int color, int key, const std::string& name) override;
  WorkHandle do_all_reduce(const Tensor& tensor, ReduceOp op) override;
  WorkHandle do_all_gather(const Tensor& output, const Tensor& input,
                           const std::vector<int64_t>& counts) override;
  WorkHandle do_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                               const std::vector<int64_t>& counts) override;
  WorkHandle do_broadcast(const Tensor& tensor, int root) override;
  WorkHandle do_all_to_all(const Tensor& output, const Tensor& input,
                           const std::vector<int64_t>& send_counts,
                           const std::vector<int64_t>& recv_counts) override;
  WorkHandle do_send(const Tensor& tensor, int dst, int tag) override;
  WorkHandle do_recv(const Tensor& tensor, int src, int tag) override;
  WorkHandle do_barrier() override;

 private:
  void check_tag(const char* op, int tag) const;
  // Queues a collective as the deferred work (posting the previous one).
  WorkHandle issue(std::shared_ptr<MpiWork> work) const;

  MPI_Comm comm_;
};

bool MpiComm::equal_counts(const char* op, const std::vector<int64_t>& counts) const {
  int64_t total = 0;
  bool equal = true;
  for (int64_t k : counts) {
    total += k;
    equal = equal && k == counts[0];
  }
  const int64_t max = g_max_count.load(std::memory_order_relaxed);
  if (total > max) {
    fail("mpi: {} on group '{}' (rank {} of {}): counts [{}] sum to more elements than "
         "MPI's int counts allow ({}); split the tensor into smaller collectives", op, name(),
         rank(), size(), fmt::join(counts, ", "), max);
  }
  return equal;
}

// Counts and running offsets as MPI's ints (equal_counts checked that they fit).
void to_ints(const std::vector<int64_t>& counts, std::vector<int>& ints, std::vector<int>* displs) {
  ints.resize(counts.size());
  if (displs != nullptr) displs->resize(counts.size());
  int64_t offset = 0;
  for (size_t r = 0; r < counts.size(); ++r) {
    ints[r] = static_cast<int>(counts[r]);
    if (displs != nullptr) (*displs)[r] = static_cast<int>(offset);
    offset += counts[r];
  }
}

void MpiComm::check_tag(const char* op, int tag) const {
  int* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &found);
  const int max_tag = found && ub != nullptr ? *ub : 32767;
  TS_CHECK(tag >= 0 && tag <= max_tag,
           "mpi: {} on group '{}' (rank {} of {}): tag {} outside MPI's range [0, {}]", op,
           name(), rank(), size(), tag, max_tag);
}

WorkHandle MpiComm::issue(std::shared_ptr<MpiWork> work) const {
  reap_sends();
  std::shared_ptr<MpiWork> prev;
  {
    std::lock_guard<std::mutex> lock(g_issue_mu);
    prev = post_deferred_locked();
    g_deferred = work;
  }
  return work;
}

// ---- MpiWork ---------------------------------------------------------------------------------

MpiWork::~MpiWork() {
  // A handle dropped while its call is in flight: MPI still writes into our temporaries.
  if (state_ == State::posted && !mpi_finalized()) {
    for (MPI_Request& r : requests_) MPI_Wait(&r, MPI_STATUS_IGNORE);
  }
}

void MpiWork::post_now() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != State::deferred) return;
  try {
    run(&requests_);
    state_ = State::posted;
  } catch (...) {
    // Requests posted before the failing one (chunked calls) still complete in wait().
    error_ = std::current_exception();
    state_ = State::posted;
  }
}

void MpiWork::complete_locked() {
  if (state_ == State::done) return;
  internal::WatchedWait watched(fmt::format("{} on group '{}' (rank {} of {})", op(),
                                            comm().name(), comm().rank(), comm().size()));
  try {
    if (state_ == State::deferred) {
      run(nullptr);
    } else {
      for (MPI_Request& r : requests_) {
        MPI_Status status;
        int rc = MPI_Wait(&r, &status);
        if (rc == MPI_ERR_IN_STATUS) rc = status.MPI_ERROR;
        comm().check(rc, posted_call());
      }
    }
    if (!error_) finish();
  } catch (...) {
    if (!error_) error_ = std::current_exception();
  }
  state_ = State::done;
}

void MpiWork::wait() {
  {
    std::lock_guard<std::mutex> lock(g_issue_mu);
    if (g_deferred.get() == this) g_deferred.reset();  // ours to run, blocking
  }
  std::lock_guard<std::mutex> lock(mu_);
  complete_locked();
  if (error_) std::rethrow_exception(error_);
}

bool MpiWork::is_completed() {
  {
    std::lock_guard<std::mutex> lock(g_issue_mu);
    if (g_deferred.get() == this) {
      g_deferred.reset();
      post_now();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == State::done) return true;
  if (state_ == State::deferred) return false;  // another thread's wait() is about to run it
  int done = 0;
  const int rc = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                             MPI_STATUSES_IGNORE);
  if (rc != MPI_SUCCESS || done) complete_locked();  // MPI_Wait on completed requests: no-op
  return state_ == State::done;
}

// A work described by a State struct: run(comm, requests), finish(comm), and the name.
template <typename S>
class StateWork final : public MpiWork {
 public:
  StateWork(std::shared_ptr<const MpiComm> comm, S state)
      : MpiWork(std::move(comm)), s_(std::move(state)) {}

 private:
  void run(Requests* requests) override { s_.run(comm(), requests); }
  void finish() override { s_.finish(comm()); }
  const char* posted_call() const override { return S::kPosted; }
  const char* op() const override { return S::kOp; }
  S s_;
};

template <typename S>
std::shared_ptr<MpiWork> make_work(const MpiComm& comm, S state) {
  return std::make_shared<StateWork<S>>(comm.shared_from_this(), std::move(state));
}

// ---- collectives -----------------------------------------------------------------------------

struct AllReduce {
  static constexpr const char* kOp = "all_reduce";
  static constexpr const char* kPosted = "MPI_Iallreduce";
  Tensor tensor;
  Reduction red;
  Tensor wide;  // f16/bf16: the values in f32

  void run(const MpiComm& c, Requests* requests) {
    char* base = red.widen ? static_cast<char*>(wide.raw_data()) : at(tensor, 0);
    const int64_t esize = red.widen ? 4 : dtype_size(tensor.dtype());
    for_chunks(tensor.numel(), [&](int64_t offset, int n) {
      void* p = base + offset * esize;
      if (requests == nullptr) {
        c.check(MPI_Allreduce(MPI_IN_PLACE, p, n, red.type, red.op, c.handle()), "MPI_Allreduce");
      } else {
        MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
        c.check(MPI_Iallreduce(MPI_IN_PLACE, p, n, red.type, red.op, c.handle(), &r), kPosted);
        requests->push_back(r);
      }
    });
  }
  void finish(const MpiComm& c) {
    if (red.widen || red.avg) {
      store_reduced(red.widen ? wide : tensor, tensor, red.avg ? c.size() : 1);
    }
  }
};

struct AllGather {
  static constexpr const char* kOp = "all_gather";
  static constexpr const char* kPosted = "MPI_Iallgather(v)";
  Tensor output, input;
  std::vector<int> counts, displs;  // counts empty: equal blocks of input.numel()

  void run(const MpiComm& c, Requests* requests) {
    const MPI_Datatype type = move_type(input.dtype());
    // In place when the input already sits in its slot of the output (MPI forbids aliasing).
    const int64_t own = counts.empty() ? c.rank() * input.numel() : displs[c.rank()];
    const void* send = input.raw_data() == at(output, own) ? MPI_IN_PLACE : input.raw_data();
    const int n = static_cast<int>(input.numel());
    if (requests == nullptr) {
      c.check(counts.empty()
                  ? MPI_Allgather(send, n, type, output.raw_data(), n, type, c.handle())
                  : MPI_Allgatherv(send, n, type, output.raw_data(), counts.data(),
                                   displs.data(), type, c.handle()),
              counts.empty() ? "MPI_Allgather" : "MPI_Allgatherv");
      return;
    }
    MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
    c.check(counts.empty()
                ? MPI_Iallgather(send, n, type, output.raw_data(), n, type, c.handle(), &r)
                : MPI_Iallgatherv(send, n, type, output.raw_data(), counts.data(),
                                  displs.data(), type, c.handle(), &r),
            counts.empty() ? "MPI_Iallgather" : "MPI_Iallgatherv");
    requests->push_back(r);
  }
  void finish(const MpiComm&) {}
};

struct ReduceScatter {
  static constexpr const char* kOp = "reduce_scatter";
  static constexpr const char* kPosted = "MPI_Ireduce_scatter(_block)";
  Tensor output, input;
  Reduction red;
  std::vector<int> counts;  // empty: equal blocks of output.numel()
  Tensor wide_in, wide_out;  // f16/bf16: f32 buffers

  void run(const MpiComm& c, Requests* requests) {
    const void* send = red.widen ? wide_in.raw_data() : input.raw_data();
    void* recv = red.widen ? wide_out.raw_data() : output.raw_data();
    const int n = static_cast<int>(output.numel());
    if (requests == nullptr) {
      c.check(counts.empty()
                  ? MPI_Reduce_scatter_block(send, recv, n, red.type, red.op, c.handle())
                  : MPI_Reduce_scatter(send, recv, counts.data(), red.type, red.op, c.handle()),
              counts.empty() ? "MPI_Reduce_scatter_block" : "MPI_Reduce_scatter");
      return;
    }
    MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
    c.check(counts.empty()
                ? MPI_Ireduce_scatter_block(send, recv, n, red.type, red.op, c.handle(), &r)
                : MPI_Ireduce_scatter(send, recv, counts.data(), red.type, red.op, c.handle(), &r),
            counts.empty() ? "MPI_Ireduce_scatter_block" : "MPI_Ireduce_scatter");
    requests->push_back(r);
  }
  void finish(const MpiComm& c) {
    if (red.widen || red.avg) {
      store_reduced(red.widen ? wide_out : output, output, red.avg ? c.size() : 1);
    }
  }
};

struct Broadcast {
  static constexpr const char* kOp = "broadcast";
  static constexpr const char* kPosted = "MPI_Ibcast";
  Tensor tensor;
  int root;

  void run(const MpiComm& c, Requests* requests) {
    const MPI_Datatype type = move_type(tensor.dtype());
    for_chunks(tensor.numel(), [&](int64_t offset, int n) {
      if (requests == nullptr) {
        c.check(MPI_Bcast(at(tensor, offset), n, type, root, c.handle()), "MPI_Bcast");
      } else {
        MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
        c.check(MPI_Ibcast(at(tensor, offset), n, type, root, c.handle(), &r),
                kPosted);
        requests->push_back(r);
      }
    });
  }
  void finish(const MpiComm&) {}
};

struct AllToAll {
  static constexpr const char* kOp = "all_to_all";
  static constexpr const char* kPosted = "MPI_Ialltoall(v)";
  Tensor output, input;
  // All empty: equal blocks.
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;

  void run(const MpiComm& c, Requests* requests) {
    const MPI_Datatype type = move_type(input.dtype());
    const bool equal = send_counts.empty();
    const int n = static_cast<int>(input.numel() / c.size());
    if (requests == nullptr) {
      c.check(equal ? MPI_Alltoall(input.raw_data(), n, type, output.raw_data(), n, type,
                                   c.handle())
                    : MPI_Alltoallv(input.raw_data(), send_counts.data(), send_displs.data(),
                                    type, output.raw_data(), recv_counts.data(),
                                    recv_displs.data(), type, c.handle()),
              equal ? "MPI_Alltoall" : "MPI_Alltoallv");
      return;
    }
    MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
    c.check(equal ? MPI_Ialltoall(input.raw_data(), n, type, output.raw_data(), n, type,
                                  c.handle(), &r)
                  : MPI_Ialltoallv(input.raw_data(), send_counts.data(), send_displs.data(),
                                   type, output.raw_data(), recv_counts.data(),
                                   recv_displs.data(), type, c.handle(), &r),
            equal ? "MPI_Ialltoall" : "MPI_Ialltoallv");
    requests->push_back(r);
  }
  void finish(const MpiComm&) {}
};

struct Barrier {
  static constexpr const char* kOp = "barrier";
  static constexpr const char* kPosted = "MPI_Ibarrier";
  void run(const MpiComm& c, Requests* requests) {
    if (requests == nullptr) {
      c.check(MPI_Barrier(c.handle()), "MPI_Barrier");
    } else {
      MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
      c.check(MPI_Ibarrier(c.handle(), &r), kPosted);
      requests->push_back(r);
    }
  }
  void finish(const MpiComm&) {}
};

// A recv is posted at once (never deferred): a peer's send may be waiting for it.
struct Recv {
  static constexpr const char* kOp = "recv";
  static constexpr const char* kPosted = "MPI_Irecv";
  Tensor tensor;
  int src, tag;

  void run(const MpiComm& c, Requests* requests) {
    const MPI_Datatype type = move_type(tensor.dtype());
    for_chunks(tensor.numel(), [&](int64_t offset, int n) {
      MPI_Request r = MPI_REQUEST_NULL;  // kept only if the call succeeded
      c.check(MPI_Irecv(at(tensor, offset), n, type, src, tag, c.handle(), &r),
              kPosted);
      requests->push_back(r);
    });
  }
  void finish(const MpiComm&) {}
};

// ---- MpiComm's collectives -------------------------------------------------------------------

std::shared_ptr<Communicator> MpiComm::do_split(int color, int key, const std::string& name) {
  reap_sends();
  std::shared_ptr<MpiWork> prev;
  MPI_Comm sub = MPI_COMM_NULL;
  {
    // Blocking and collective: whatever this rank issued before must be posted first.
    std::lock_guard<std::mutex> lock(g_issue_mu);
    prev = post_deferred_locked();
  }
  {
    internal::WatchedWait watched(fmt::format("split of group '{}' (rank {} of {})",
                                              Communicator::name(), rank(), size()));
    check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
  }
  return wrap(sub, name);
}

WorkHandle MpiComm::do_all_reduce(const Tensor& tensor, ReduceOp op) {
  AllReduce s{tensor, reduction_for(tensor.dtype(), op), {}};
  if (s.red.widen) s.wide = widen(tensor);
  return issue(make_work(*this, std::move(s)));
}

WorkHandle MpiComm::do_all_gather(const Tensor& output, const Tensor& input,
                                  const std::vector<int64_t>& counts) {
  AllGather s{output, input, {}, {}};
  if (!equal_counts("all_gather", counts)) to_ints(counts, s.counts, &s.displs);
  return issue(make_work(*this, std::move(s)));
}

WorkHandle MpiComm::do_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                                      const std::vector<int64_t>& counts) {
  ReduceScatter s{output, input, reduction_for(input.dtype(), op), {}, {}, {}};
  if (!equal_counts("reduce_scatter", counts)) to_ints(counts, s.counts, nullptr);
  if (s.red.widen) {
    s.wide_in = widen(input);
    s.wide_out = Tensor::empty(output.shape(), DType::f32);
  }
  return issue(make_work(*this, std::move(s)));
}

WorkHandle MpiComm::do_broadcast(const Tensor& tensor, int root) {
  return issue(make_work(*this, Broadcast{tensor, root}));
}

WorkHandle MpiComm::do_all_to_all(const Tensor& output, const Tensor& input,
                                  const std::vector<int64_t>& send_counts,
                                  const std::vector<int64_t>& recv_counts) {
  AllToAll s{output, input, {}, {}, {}, {}};
  const bool equal_send = equal_counts("all_to_all", send_counts);
  const bool equal_recv = equal_counts("all_to_all", recv_counts);
  if (!equal_send || !equal_recv || send_counts[0] != recv_counts[0]) {
    to_ints(send_counts, s.send_counts, &s.send_displs);
    to_ints(recv_counts, s.recv_counts, &s.recv_displs);
  }
  return issue(make_work(*this, std::move(s)));
}

WorkHandle MpiComm::do_send(const Tensor& tensor, int dst, int tag) {
  check_tag("send", tag);
  reap_sends();
  // Sent from a private copy, so the handle is complete at once and a send posted before the
  // peer's recv cannot deadlock (MPI_Send blocks above the eager limit until matched).
  const int64_t bytes = tensor.nbytes();
  std::shared_ptr<char[]> copy(new char[static_cast<size_t>(std::max<int64_t>(bytes, 1))]);
  std::memcpy(copy.get(), tensor.raw_data(), static_cast<size_t>(bytes));
  const MPI_Datatype type = move_type(tensor.dtype());
  const int64_t esize = dtype_size(tensor.dtype());
  std::vector<MPI_Request> requests;
  {
    std::lock_guard<std::mutex> lock(g_issue_mu);
    std::shared_ptr<MpiWork> prev = post_deferred_locked();
    for_chunks(tensor.numel(), [&](int64_t offset, int n) {
      MPI_Request r;
      check(MPI_Isend(copy.get() + offset * esize, n, type, dst, tag, comm_, &r), "MPI_Isend");
      requests.push_back(r);
    });
  }
  std::lock_guard<std::mutex> lock(g_send_mu);
  const std::string where =
      fmt::format("group '{}' failed on rank {} of {}", name(), rank(), size());
  for (MPI_Request r : requests) g_sends.push_back(PendingSend{r, copy, where});
  g_num_sends.fetch_add(static_cast<int>(requests.size()), std::memory_order_relaxed);
  return completed_work();
}

WorkHandle MpiComm::do_recv(const Tensor& tensor, int src, int tag) {
  check_tag("recv", tag);
  reap_sends();
  std::shared_ptr<MpiWork> work = make_work(*this, Recv{tensor, src, tag});
  std::shared_ptr<MpiWork> prev;
  {
    std::lock_guard<std::mutex> lock(g_issue_mu);
    prev = post_deferred_locked();
    work->post_now();
  }
  return work;
}

WorkHandle MpiComm::do_barrier() { return issue(make_work(*this, Barrier{})); }

}  // namespace

CommPtr mpi_world() {
  static const CommPtr world = [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = 0;
    if (!initialized) {
      const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) fail("mpi: MPI_Init_thread failed: {}", mpi_error_string(rc));
      std::atexit(finalize_mpi);
    } else {
      MPI_Query_thread(&provided);
    }
    // Async collectives are posted by whichever thread issues or waits next.
    TS_CHECK(provided >= MPI_THREAD_MULTIPLE,
             "mpi: the MPI library provides thread level {} but Tessera needs "
             "MPI_THREAD_MULTIPLE ({})", provided, MPI_THREAD_MULTIPLE);
    // A private duplicate: our traffic never matches the program's own MPI_COMM_WORLD calls.
    MPI_Comm dup = MPI_COMM_NULL;
    const int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    if (rc != MPI_SUCCESS) {
      fail("mpi: MPI_Comm_dup of MPI_COMM_WORLD failed: {}", mpi_error_string(rc));
    }
    return CommPtr(MpiComm::wrap(dup, "world"));
  }();
  return world;
}

bool mpi_launched() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr;
}

void mpi_abort_if_running(int code, const std::string& message) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size <= 1) return;
  std::fprintf(stderr, "rank %d of %d failed; aborting the other ranks: %s\n", rank, size,
               message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code == 0 ? 1 : code);
}

namespace internal {
int64_t set_mpi_max_count(int64_t elements) {
  TS_CHECK(elements >= 1 && elements <= INT32_MAX,
           "set_mpi_max_count: {} is outside [1, {}]", elements, INT32_MAX);
  return g_max_count.exchange(elements);
}
}  // namespace internal

}  // namespace tessera::parallel
