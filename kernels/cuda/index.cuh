// Launchers for the indexing ops on CUDA (embedding, index_select, index_add, gather,
// scatter_add), and the device-side record of bad indices shared by every op that reads
// indices (these ops, cross_entropy's targets, max_pool2d_backward's argmax).
//
// Index errors cannot throw where they are found (the host does not wait for kernels), so a
// kernel that meets an out-of-range index writes zeros (or skips the add) and records the
// first offence in the device's DeviceErrorRecord; the host glue polls the record without
// blocking and throws tessera::Error naming the op, the index and the size at the next
// index-reading op on that device once the record's copy has landed (index.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

// Which op found the bad index (ErrorOp names for the message).
enum ErrorOp : int {
  kErrEmbedding = 1, kErrIndexSelect, kErrIndexAdd, kErrGather, kErrScatterAdd,
  kErrCrossEntropy, kErrCrossEntropyBackward, kErrMaxPoolBackward,
};

struct DeviceErrorRecord {
  unsigned int flag;  // 0: no error; set once by atomicCAS
  int op;             // ErrorOp
  int64_t index, size, dim;
};

// Host side (index.cc): the record of CUDA device `device` (allocated once, zeroed), and the
// non-blocking check that throws tessera::Error for an offence recorded by earlier launches.
DeviceErrorRecord* device_error_record(int device);
void poll_device_errors(int device);
// Queues a copy of the record to the host after the launches just made (compute stream).
void queue_device_error_check(int device, cudaStream_t stream);

#ifdef __CUDACC__
// Records the first bad index on this device (later ones are dropped: one message is enough).
__device__ __forceinline__ void report_bad_index(DeviceErrorRecord* e, int op, int64_t index,
                                                 int64_t size, int64_t dim) {
  if (e != nullptr && atomicCAS(&e->flag, 0u, 1u) == 0u) {
    e->op = op;
    e->index = index;
    e->size = size;
    e->dim = dim;
  }
}
#endif

// Bytes of workspace launch_index_add needs for n indices.
int64_t index_add_workspace_bytes(int64_t n);

// w [V, D] contiguous; idx any shape (i32/i64, contiguous); out [numel(idx), D].
void launch_embedding(const DevTensor& out, const DevTensor& w, const DevTensor& idx,
                      DeviceErrorRecord* err, cudaStream_t stream);
// x contiguous viewed as [outer, mid, inner]; idx [n]; out [outer, n, inner].
void launch_index_select(const DevTensor& out, const DevTensor& x, const DevTensor& idx,
                         int64_t outer, int64_t mid, int64_t inner, int64_t dim,
                         DeviceErrorRecord* err, cudaStream_t stream);
// out (already holding x) [outer, mid, inner] += src [outer, n, inner] at idx [n] along mid,
// adding equal indices in position order (the CPU's order, so results match bit for bit).
void launch_index_add(const DevTensor& out, const DevTensor& src, const DevTensor& idx,
                      int64_t outer, int64_t mid, int64_t inner, int64_t dim, void* workspace,
                      DeviceErrorRecord* err, cudaStream_t stream);
// out [idx shape] = x[... idx ...] along dim; x and idx may be strided.
void launch_gather(const DevTensor& out, const DevTensor& x, const DevTensor& idx, int dim,
                   DeviceErrorRecord* err, cudaStream_t stream);
// out (already holding x, contiguous) gets src added at idx along dim; idx and src strided.
void launch_scatter_add(const DevTensor& out, const DevTensor& src, const DevTensor& idx,
                        int dim, DeviceErrorRecord* err, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
