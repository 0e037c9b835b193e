// Communicators: one interface for collectives over a group of ranks, with three backends
// (threads.h: ranks as threads of one process; mpi.h: one process per rank; nccl.h: CUDA
// tensors, --config=cuda only). Meshes (parallel/mesh.h) split the world into one
// sub-communicator per axis; redistribution (parallel/redistribute.h) lowers to these calls.
//
//   comm.all_reduce(t, ReduceOp::sum);                        // in place, every member
//   WorkHandle h = comm.all_gather_async(out, shard);         // out: members' shards in order
//   ... compute ...
//   h->wait();                                                // rethrows a failed collective
//
// Every collective must be called by every member of the group, in the same order (as with
// MPI and NCCL). Buffers are contiguous tensors of any dtype, on the host or (except where
// the backend takes them itself, as NCCL does) on a device: the base stages a device tensor
// through host copies (staging.h) for the backend, once for all CPU backends. The
// caller keeps them alive until the handle's wait() returns. Public methods validate their
// arguments (tessera::Error naming the collective, the group and the sizes), record the call
// in the calling thread's comm log (comm_log.h), then hand over to the backend.
//
// Semantics shared by every backend (the tests check each against a single-process loop):
//   - Flat buffers: all_gather places member r's input at element offset sum(counts[< r]) of
//     the output; reduce_scatter reduces the input's block r (same layout) into member r's
//     output; all_to_all sends input block j (send_counts) to member j and receives member
//     j's block for us at offset sum(recv_counts[< j]). Empty counts mean equal blocks.
//   - Reductions run in member order 0, 1, ..., n-1 (deterministic where the backend can
//     promise it: threads always; MPI as the library does), f16/bf16 accumulate in f32 and
//     round once; avg is the sum divided by n (floating dtypes only); for bool, sum and max
//     are logical or, min logical and.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::parallel {

enum class ReduceOp : uint8_t { sum, avg, max, min };
std::string_view reduce_op_name(ReduceOp op);

// A collective in flight. wait() blocks until it completed (its output buffers hold the
// result) and rethrows its error; calling wait() again returns at once.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};
using WorkHandle = std::shared_ptr<Work>;

// A Work that is already complete (synchronous backends, empty collectives).
WorkHandle completed_work();

// Waits for `work` (when set) and drops its error: for destructors and cleanup paths that
// must not free a buffer a collective still uses, where the failure is (or will be)
// reported where it arose.
void wait_ignoring_errors(const WorkHandle& work);

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }  // this process/thread's index in the group
  int size() const { return size_; }
  // "world", or what the creator named it ("tp", "dp,tp"); the comm log records it.
  const std::string& name() const { return name_; }
  virtual std::string_view backend() const = 0;

  // ---- group management (collective over this communicator) -----------------------------
  // Members with equal `color` form one new communicator, ranked by (key, rank), as
  // MPI_Comm_split. Every member calls it; each gets its own group.
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name);

  // ---- collectives ---------------------------------------------------------------------
  WorkHandle all_reduce_async(const Tensor& tensor, ReduceOp op);
  // output holds sum(counts) elements (counts per member; empty: size() * input.numel()).
  WorkHandle all_gather_async(const Tensor& output, const Tensor& input,
                              std::vector<int64_t> counts = {});
  // input holds sum(counts) elements; member r's output holds counts[r].
  WorkHandle reduce_scatter_async(const Tensor& output, const Tensor& input, ReduceOp op,
                                  std::vector<int64_t> counts = {});
  WorkHandle broadcast_async(const Tensor& tensor, int root);
  WorkHandle all_to_all_async(const Tensor& output, const Tensor& input,
                              std::vector<int64_t> send_counts = {},
                              std::vector<int64_t> recv_counts = {});
  // Point to point; a send is matched by the recv of the same (peer, tag) in order.
  WorkHandle send_async(const Tensor& tensor, int dst, int tag = 0);
  WorkHandle recv_async(const Tensor& tensor, int src, int tag = 0);
  WorkHandle barrier_async();

  // Blocking forms: the async call followed by wait().
  void all_reduce(const Tensor& tensor, ReduceOp op) { all_reduce_async(tensor, op)->wait(); }
  void all_gather(const Tensor& output, const Tensor& input, std::vector<int64_t> counts = {}) {
    all_gather_async(output, input, std::move(counts))->wait();
  }
  void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                      std::vector<int64_t> counts = {}) {
    reduce_scatter_async(output, input, op, std::move(counts))->wait();
  }
  void broadcast(const Tensor& tensor, int root) { broadcast_async(tensor, root)->wait(); }
  void all_to_all(const Tensor& output, const Tensor& input, std::vector<int64_t> send_counts = {},
                  std::vector<int64_t> recv_counts = {}) {
    all_to_all_async(output, input, std::move(send_counts), std::move(recv_counts))->wait();
  }
  void send(const Tensor& tensor, int dst, int tag = 0) { send_async(tensor, dst, tag)->wait(); }
  void recv(const Tensor& tensor, int src, int tag = 0) { recv_async(tensor, src, tag)->wait(); }
  void barrier() { barrier_async()->wait(); }

 protected:
  Communicator(int rank, int size, std::string name)
      : rank_(rank), size_(size), name_(std::move(name)) {}

  // False for a backend that moves device tensors itself; otherwise the public methods hand
  // the do_* below host copies of device tensors and copy results back (staging.h).
  virtual bool stages_device_tensors() const { return true; }

  // Backends implement these; arguments are validated and counts filled in (never empty),
  // and buffers are on the host unless stages_device_tensors() is false.
  virtual std::shared_ptr<Communicator> do_split(int color, int key, const std::string& name) = 0;
  virtual WorkHandle do_all_reduce(const Tensor& tensor, ReduceOp op) = 0;
  virtual WorkHandle do_all_gather(const Tensor& output, const Tensor& input,
                                   const std::vector<int64_t>& counts) = 0;
  virtual WorkHandle do_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op,
                                       const std::vector<int64_t>& counts) = 0;
  virtual WorkHandle do_broadcast(const Tensor& tensor, int root) = 0;
  virtual WorkHandle do_all_to_all(const Tensor& output, const Tensor& input,
                                   const std::vector<int64_t>& send_counts,
                                   const std::vector<int64_t>& recv_counts) = 0;
  virtual WorkHandle do_send(const Tensor& tensor, int dst, int tag) = 0;
  virtual WorkHandle do_recv(const Tensor& tensor, int src, int tag) = 0;
  virtual WorkHandle do_barrier() = 0;

 private:
  bool staged(const Tensor& t) const;  // a device tensor this backend takes host copies of

  int rank_, size_;
  std::string name_;
};

using CommPtr = std::shared_ptr<Communicator>;

// Bytes this rank puts on the wire for one collective under a ring/pairwise schedule (the
// comm log and the redistribution cost model both use these, nccl-tests' bus convention):
//   all_reduce 2 (n-1)/n x bytes; all_gather (n-1) x own input; reduce_scatter and
//   all_to_all: the input minus the block that stays here; broadcast (n-1) x bytes at the
//   root, 0 elsewhere; send: bytes; recv and barrier: 0.
int64_t all_reduce_wire_bytes(int64_t bytes, int n);
int64_t all_gather_wire_bytes(int64_t input_bytes, int n);
int64_t reduce_scatter_wire_bytes(int64_t input_bytes, int64_t own_block_bytes);

}  // namespace tessera::parallel
