// The NCCL backend (see nccl.h). Built only under --config=cuda (parallel/comm/BUILD selects
// it). Every launch runs on the device's communication stream (kernels/cuda/runtime.h) after
// an event on the compute stream; its handle holds the buffers until the host has seen the
// collective's `done` event, so the caching allocator never reuses them early.
#include "parallel/comm/nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::parallel {
namespace {

using cuda_kernels::DeviceGuard;

ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::b8:
    case DType::u8: return ncclUint8;
  }
  return ncclUint8;
}

// Bool holds 0/1, so max is logical or and min logical and (sum and max both mean or).
ncclRedOp_t nccl_op(DType dt, ReduceOp op) {
  if (dt == DType::b8) return op == ReduceOp::min ? ncclMin : ncclMax;
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

bool is_half(DType dt) { return dt == DType::f16 || dt == DType::bf16; }

// An f32 copy of an f16/bf16 buffer (on the compute stream, before the launch's event).
Tensor widened(const Tensor& t) {
  NoGradGuard no_grad;
  return t.cast(DType::f32);
}

char* at(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.raw_data()) + elements * dtype_size(t.dtype());
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> out(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) out[i] = out[i - 1] + counts[i - 1];
  return out;
}

class NcclComm;

// A collective in flight on the communication stream: `done` is recorded after it.
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<const NcclComm> comm, cudaEvent_t done, std::vector<Tensor> keep,
           std::function<void()> finish)
      : comm_(std::move(comm)), done_(done), keep_(std::move(keep)), finish_(std::move(finish)) {}
  ~NcclWork() override;
  void wait() override;
  bool is_completed() override;

 private:
  std::shared_ptr<const NcclComm> comm_;
  cudaEvent_t done_;
  std::vector<Tensor> keep_;       // inputs, outputs and temporaries the stream still uses
  std::function<void()> finish_;  // after completion: f16/bf16 rounding back
  std::mutex mu_;
  bool completed_ = false;
  std::exception_ptr error_;
};

class NcclComm final : public Communicator, public std::enable_shared_from_this<NcclComm> {
 public:
  // The communication stream is the device's shared one (runtime.h): communicators of one
  // device run their collectives in issue order, which is also NCCL's requirement.
  NcclComm(ncclComm_t comm, int rank, int size, const std::string& name, int device)
      : Communicator(rank, size, name), comm_(comm), device_(device),
        stream_(cuda_kernels::comm_stream(cuda(device))),
        scratch_(zeros({1}, DType::f32, cuda(device))) {}
  ~NcclComm() override {
    DeviceGuard guard(cuda(device_));
    std::vector<Tensor> keep;  // alive until the stream finished with them
    // Staged sends never matched by a later call go out now, so the peer's recv completes.
    try {
      std::lock_guard<std::mutex> lock(mu_);
      if (!staged_.empty()) cudaEventDestroy(enqueue_locked("ncclSend", [] {}, keep, Staged::join));
    } catch (const std::exception&) {
      // Tearing down: nothing left to report to.
    }
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
  }
  std::string_view backend() const override { return "nccl"; }
  // CUDA tensors go to NCCL as they are.
  bool stages_device_tensors() const override { return false; }
  int device() const { return device_; }

  void check(ncclResult_t r, const char* call) const {
    if (r != ncclSuccess && r != ncclInProgress) [[unlikely]] {
      const char* last = ncclGetLastError(comm_);
      fail("nccl: {} on group '{}' failed on rank {}: {}{}{}", call, name(), rank(),
           ncclGetErrorString(r), last != nullptr && *last ? " - " : "", last ? last : "");
    }
  }
  void check_cuda(cudaError_t e, const char* call) const {
    if (e != cudaSuccess) [[unlikely]] {
      fail("nccl: {} on group '{}' failed on rank {}: {}", call, name(), rank(),
           cudaGetErrorString(e));
    }
  }
  // A collective that failed asynchronously (a peer died, a network error) surfaces here.
  void check_async() const {
    ncclResult_t state = ncclSuccess;
    check(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError");
    check(state, "an earlier operation");
  }

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
  struct StagedSend {
    Tensor copy;  // private device copy of the sent tensor
    int dst;
  };

  void check_device(const char* op, const Tensor& t) const {
    TS_CHECK(t.device() == cuda(device_),
             "nccl: {} on group '{}' (rank {}): tensor {} is on {} but this communicator "
             "uses cuda:{}", op, name(), rank(), shape_str(t.shape()), t.device(), device_);
  }

  // What a launch does with the staged sends: leave them staged (a send's own staging copy),
  // issue them in their own group first (collectives), or in the launch's group (recv).
  enum class Staged { keep, before, join };
  // Queues `issue` (NCCL calls) on the communication stream after the compute stream's work,
  // inside one NCCL group, handling staged sends as `staged` says (their copies are
  // appended to `keep`). Returns the event recorded after it.
  cudaEvent_t enqueue_locked(const char* call, const std::function<void()>& issue,
                             std::vector<Tensor>& keep, Staged staged);
  // enqueue_locked wrapped in a handle whose wait() runs `finish`.
  std::shared_ptr<NcclWork> launch_locked(const char* call, const std::function<void()>& issue,
                                          std::vector<Tensor> keep, std::function<void()> finish,
                                          Staged staged) {
    cudaEvent_t done = enqueue_locked(call, issue, keep, staged);
    return std::make_shared<NcclWork>(shared_from_this(), done, std::move(keep), std::move(finish));
  }
  std::shared_ptr<NcclWork> launch(const char* call, const std::function<void()>& issue,
                                   std::vector<Tensor> keep,
                                   std::function<void()> finish = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    return launch_locked(call, issue, std::move(keep), std::move(finish), Staged::before);
  }

  ncclComm_t comm_;
  int device_;
  cudaStream_t stream_;  // the device's communication stream (not ours to destroy)
  std::mutex mu_;  // one launch at a time: NCCL calls on a communicator must be ordered
  std::vector<StagedSend> staged_;  // guarded by mu_
  Tensor scratch_;                  // barrier's one element
};

// ---- NcclWork -------------------------------------------------------------------------------

NcclWork::~NcclWork() {
  // A handle dropped before wait(): the stream may still read or write keep_.
  if (!completed_) cudaEventSynchronize(done_);
  cudaEventDestroy(done_);
}

void NcclWork::wait() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!completed_) {
    completed_ = true;
    try {
      const Device d = cuda(comm_->device());
      DeviceGuard guard(d);
      comm_->check_cuda(cudaEventSynchronize(done_), "cudaEventSynchronize");
      comm_->check_async();
      // Kernels queued later on the compute stream see the result (a no-op for the host,
      // which already waited, but not for work queued from other threads).
      comm_->check_cuda(cudaStreamWaitEvent(cuda_kernels::compute_stream(d), done_, 0),
                        "cudaStreamWaitEvent");
      if (finish_) {
        NoGradGuard no_grad;  // f16/bf16 rounding back: buffer copies, never a graph
        finish_();
      }
    } catch (...) {
      error_ = std::current_exception();
    }
    keep_.clear();
  }
  if (error_) std::rethrow_exception(error_);
}

bool NcclWork::is_completed() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (completed_) return true;
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: keep it from failing the next kernel launch check
      return false;
    }
  }
  try {
    wait();  // done: finish it here
  } catch (...) {
    // Failed: kept for wait(), which rethrows it (is_completed never throws, as elsewhere).
  }
  return true;
}

// ---- NcclComm -------------------------------------------------------------------------------

cudaEvent_t NcclComm::enqueue_locked(const char* call, const std::function<void()>& issue,
                                     std::vector<Tensor>& keep, Staged staged) {
  const Device d = cuda(device_);
  DeviceGuard guard(d);
  // The communication stream starts after everything already queued for compute.
  cuda_kernels::stream_wait(stream_, cuda_kernels::compute_stream(d), d);
  cudaEvent_t done = nullptr;

  std::vector<StagedSend> sends;
  if (staged != Staged::keep) sends.swap(staged_);
  auto issue_sends = [&] {
    for (const StagedSend& s : sends) {
      check(ncclSend(s.copy.raw_data(), static_cast<size_t>(s.copy.numel()),
                     nccl_type(s.copy.dtype()), s.dst, comm_, stream_), "ncclSend");
      keep.push_back(s.copy);
    }
  };
  if (staged == Staged::before && !sends.empty()) {
    check(ncclGroupStart(), "ncclGroupStart");
    issue_sends();
    check(ncclGroupEnd(), "ncclGroupEnd (staged sends)");
  }
  check(ncclGroupStart(), "ncclGroupStart");
  try {
    if (staged == Staged::join) issue_sends();
    issue();
  } catch (...) {
    ncclGroupEnd();  // close the group so the communicator stays usable
    throw;
  }
  check(ncclGroupEnd(), call);

  check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(done, stream_), "cudaEventRecord");
  return done;
}

std::shared_ptr<Communicator> NcclComm::do_split(int color, int key, const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!staged_.empty()) launch_locked("ncclSend", [] {}, {}, nullptr, Staged::join)->wait();
  DeviceGuard guard(cuda(device_));
  ncclComm_t sub = nullptr;
  check(ncclCommSplit(comm_, color, key, &sub, nullptr), "ncclCommSplit");
  int rank = 0, size = 0;
  check(ncclCommUserRank(sub, &rank), "ncclCommUserRank");
  check(ncclCommCount(sub, &size), "ncclCommCount");
  return std::make_shared<NcclComm>(sub, rank, size, name, device_);
}

WorkHandle NcclComm::do_all_reduce(const Tensor& tensor, ReduceOp op) {
  check_device("all_reduce", tensor);
  // Every member has the same count, so all of them skip together.
  if (tensor.numel() == 0) return completed_work();
  // f16/bf16: reduce a widened copy, round back once in wait().
  const Tensor buf = is_half(tensor.dtype()) ? widened(tensor) : tensor;
  const ncclRedOp_t rop = nccl_op(tensor.dtype(), op);
  auto issue = [&] {
    check(ncclAllReduce(buf.raw_data(), buf.raw_data(), static_cast<size_t>(buf.numel()),
                        nccl_type(buf.dtype()), rop, comm_, stream_), "ncclAllReduce");
  };
  std::function<void()> finish;
  if (!buf.is_same(tensor)) finish = [tensor, buf] { tensor.copy_(buf); };
  return launch("ncclAllReduce", issue, {tensor, buf}, std::move(finish));
}

WorkHandle NcclComm::do_all_gather(const Tensor& output, const Tensor& input,
                                   const std::vector<int64_t>& counts) {
  check_device("all_gather", input);
  check_device("all_gather", output);
  if (output.numel() == 0) return completed_work();  // sum(counts): the same on every member
  const bool equal = std::all_of(counts.begin(), counts.end(),
                                 [&](int64_t k) { return k == counts[0]; });
  const ncclDataType_t type = nccl_type(input.dtype());
  auto issue = [&] {
    if (equal) {
      check(ncclAllGather(input.raw_data(), output.raw_data(), static_cast<size_t>(counts[0]),
                          type, comm_, stream_), "ncclAllGather");
      return;
    }
    // Uneven blocks: one broadcast per member, fused by the enclosing group.
    const std::vector<int64_t> offsets = offsets_of(counts);
    for (int r = 0; r < size(); ++r) {
      if (counts[r] == 0) continue;  // every member skips it alike
      void* slot = at(output, offsets[r]);
      const void* send = r == rank() ? input.raw_data() : slot;
      check(ncclBroadcast(send, slot, static_cast<size_t>(counts[r]), type, r, comm_, stream_),
            "ncclBroadcast (uneven all_gather)");
    }
  };
  return launch(equal ? "ncclAllGather" : "ncclBroadcast (uneven all_gather)", issue,
                {output, input});
}

WorkHandle NcclComm::do_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                                       const std::vector<int64_t>& counts) {
  check_device("reduce_scatter", input);
  check_device("reduce_scatter", output);
  if (input.numel() == 0) return completed_work();  // sum(counts): the same on every member
  const bool widen = is_half(input.dtype());
  const Tensor in = widen ? widened(input) : input;
  const Tensor out = widen ? Tensor::empty(output.shape(), DType::f32, output.device()) : output;
  const bool equal = std::all_of(counts.begin(), counts.end(),
                                 [&](int64_t k) { return k == counts[0]; });
  const ncclDataType_t type = nccl_type(in.dtype());
  const ncclRedOp_t rop = nccl_op(input.dtype(), op);
  auto issue = [&] {
    if (equal) {
      check(ncclReduceScatter(in.raw_data(), out.raw_data(), static_cast<size_t>(counts[0]),
                              type, rop, comm_, stream_), "ncclReduceScatter");
      return;
    }
    // Uneven blocks: block r reduced onto member r; recvbuff matters only at the root.
    const std::vector<int64_t> offsets = offsets_of(counts);
    for (int r = 0; r < size(); ++r) {
      if (counts[r] == 0) continue;  // every member skips it alike
      check(ncclReduce(at(in, offsets[r]), r == rank() ? out.raw_data() : nullptr,
                       static_cast<size_t>(counts[r]), type, rop, r, comm_, stream_),
            "ncclReduce (uneven reduce_scatter)");
    }
  };
  std::function<void()> finish;
  if (widen) finish = [output, out] { output.copy_(out); };
  return launch(equal ? "ncclReduceScatter" : "ncclReduce (uneven reduce_scatter)", issue,
                {output, input, in, out}, std::move(finish));
}

WorkHandle NcclComm::do_broadcast(const Tensor& tensor, int root) {
  check_device("broadcast", tensor);
  if (tensor.numel() == 0) return completed_work();  // the same count on every member
  auto issue = [&] {
    check(ncclBroadcast(tensor.raw_data(), tensor.raw_data(), static_cast<size_t>(tensor.numel()),
                        nccl_type(tensor.dtype()), root, comm_, stream_), "ncclBroadcast");
  };
  return launch("ncclBroadcast", issue, {tensor});
}

WorkHandle NcclComm::do_all_to_all(const Tensor& output, const Tensor& input,
                                   const std::vector<int64_t>& send_counts,
                                   const std::vector<int64_t>& recv_counts) {
  check_device("all_to_all", input);
  check_device("all_to_all", output);
  const ncclDataType_t type = nccl_type(input.dtype());
  const int64_t esize = dtype_size(input.dtype());
  auto issue = [&] {
    const std::vector<int64_t> soff = offsets_of(send_counts), roff = offsets_of(recv_counts);
    for (int j = 0; j < size(); ++j) {
      if (j == rank()) {  // our own block: a device copy, no NCCL peer
        if (send_counts[j] == 0) continue;
        check_cuda(cudaMemcpyAsync(at(output, roff[j]), at(input, soff[j]),
                                   static_cast<size_t>(send_counts[j] * esize),
                                   cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
        continue;
      }
      // Our send count to j is j's receive count from us: both sides skip an empty block.
      if (send_counts[j] > 0) {
        check(ncclSend(at(input, soff[j]), static_cast<size_t>(send_counts[j]), type, j, comm_,
                       stream_), "ncclSend (all_to_all)");
      }
      if (recv_counts[j] > 0) {
        check(ncclRecv(at(output, roff[j]), static_cast<size_t>(recv_counts[j]), type, j, comm_,
                       stream_), "ncclRecv (all_to_all)");
      }
    }
  };
  return launch("ncclSend/ncclRecv (all_to_all)", issue, {output, input});
}

WorkHandle NcclComm::do_send(const Tensor& tensor, int dst, int tag) {
  check_device("send", tensor);
  if (tensor.numel() == 0) return completed_work();  // the matching recv skips it too
  std::lock_guard<std::mutex> lock(mu_);
  // The copy runs on the communication stream after the compute stream's work; the handle
  // completes with it. The NCCL send itself joins the next launch (see nccl.h).
  Tensor copy = Tensor::empty(tensor.shape(), tensor.dtype(), tensor.device());
  // Its block is not reused before the communication stream's work queued by the time it
  // is freed has finished, whichever handle or teardown path drops it.
  cuda_kernels::record_stream(tensor.device(), copy.raw_data(), stream_);
  auto issue = [&] {
    check_cuda(cudaMemcpyAsync(copy.raw_data(), tensor.raw_data(),
                               static_cast<size_t>(tensor.nbytes()), cudaMemcpyDeviceToDevice,
                               stream_), "cudaMemcpyAsync (send staging)");
  };
  std::shared_ptr<NcclWork> work =
      launch_locked("send staging", issue, {tensor, copy}, nullptr, Staged::keep);
  staged_.push_back(StagedSend{copy, dst});
  return work;
}

WorkHandle NcclComm::do_recv(const Tensor& tensor, int src, int tag) {
  check_device("recv", tensor);
  if (tensor.numel() == 0) return completed_work();  // the matching send skips it too
  std::lock_guard<std::mutex> lock(mu_);
  auto issue = [&] {
    check(ncclRecv(tensor.raw_data(), static_cast<size_t>(tensor.numel()),
                   nccl_type(tensor.dtype()), src, comm_, stream_), "ncclRecv");
  };
  return launch_locked("ncclRecv", issue, {tensor}, nullptr, Staged::join);
}

WorkHandle NcclComm::do_barrier() {
  const Tensor s = scratch_;
  auto issue = [&] {
    check(ncclAllReduce(s.raw_data(), s.raw_data(), 1, ncclFloat32, ncclSum, comm_, stream_),
          "ncclAllReduce (barrier)");
  };
  return launch("ncclAllReduce (barrier)", issue, {s});
}

// This host's ranks before us, from every rank's host name hash (through the bootstrap).
int local_rank(const CommPtr& bootstrap) {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const int64_t mine = static_cast<int64_t>(std::hash<std::string>{}(host) >> 1);
  Tensor all = Tensor::empty({bootstrap->size()}, DType::i64);
  bootstrap->all_gather(all, Tensor::from_vector<int64_t>({mine}, {1}));
  const std::vector<int64_t> hashes = all.to_vector<int64_t>();
  return static_cast<int>(std::count(hashes.begin(), hashes.begin() + bootstrap->rank(), mine));
}

}  // namespace

CommPtr nccl_world(const CommPtr& bootstrap, int device) {
  TS_CHECK(bootstrap != nullptr, "nccl_world: the bootstrap communicator is null");
  const std::string& name = bootstrap->name();
  const int rank = bootstrap->rank(), size = bootstrap->size();
  auto cuda_check = [&](cudaError_t e, const char* call) {
    if (e != cudaSuccess) {
      fail("nccl: {} on group '{}' failed on rank {}: {}", call, name, rank, cudaGetErrorString(e));
    }
  };
  int visible = 0;
  cuda_check(cudaGetDeviceCount(&visible), "cudaGetDeviceCount");
  TS_CHECK(visible > 0, "nccl_world on group '{}' (rank {}): no CUDA device is visible", name,
           rank);
  const int local = local_rank(bootstrap);  // collective: every rank calls it
  if (device < 0) device = local % visible;
  TS_CHECK(device < visible, "nccl_world on group '{}' (rank {}): device {} requested but {} "
           "CUDA device(s) are visible", name, rank, device, visible);

  // The unique id as bytes in an i64 tensor, broadcast from rank 0.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  Tensor id_bytes = Tensor::empty({static_cast<int64_t>((sizeof(id) + 7) / 8)}, DType::i64);
  std::memset(id_bytes.raw_data(), 0, static_cast<size_t>(id_bytes.nbytes()));
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      fail("nccl: ncclGetUniqueId on group '{}' failed on rank 0: {}", name, ncclGetErrorString(r));
    }
    std::memcpy(id_bytes.raw_data(), &id, sizeof(id));
  }
  bootstrap->broadcast(id_bytes, 0);
  std::memcpy(&id, id_bytes.raw_data(), sizeof(id));

  cuda_kernels::DeviceGuard guard(cuda(device));  // NCCL binds the communicator to it
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, size, id, rank);
  if (r != ncclSuccess) {
    fail("nccl: ncclCommInitRank on group '{}' failed on rank {}: {}", name, rank,
         ncclGetErrorString(r));
  }
  return std::make_shared<NcclComm>(comm, rank, size, name, device);
}

}  // namespace tessera::parallel
