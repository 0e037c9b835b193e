// The NCCL backend: CUDA tensors, one GPU per rank. Needs --config=cuda: without it only
// this header exists (nccl.cc is not compiled) and calling nccl_world does not link.
//
//   CommPtr boot = mpi_world();                     // any CPU communicator over the same ranks
//   CommPtr world = nccl_world(boot);               // device: local rank % visible GPUs
//   Tensor g = grad.to(cuda(world_device));
//   WorkHandle h = world->all_reduce_async(g, ReduceOp::avg);
//   ... compute on the default stream ...
//   h->wait();                                      // host waits; later kernels see g
//
// Streams: collectives run on the device's communication stream (cuda_kernels::comm_stream,
// shared by the device's communicators), after the work already queued on its compute
// stream (the legacy default stream); wait() synchronises the host with the collective's
// event and makes the compute stream wait for it too. Handles keep their buffers and
// temporaries alive until then. f16/bf16 reductions widen to f32 on the device, reduce, and
// round once (the shared semantics of communicator.h); avg is NCCL's ncclAvg, which for
// floating types scales each member's value by 1/n before summing (equal to sum / n up to
// rounding; exact for one rank). Bool reductions use max (or) and min (and). Collectives of
// zero elements return a completed handle without calling NCCL.
//
// One rank per GPU: NCCL refuses two ranks on one device. Ranks sharing a GPU (tests, a
// one-GPU machine) use the threads or MPI communicator instead, which stage CUDA tensors
// through host copies.
//
// send/recv: NCCL has no tags and its send completes only with the matching recv, so a send
// is staged (copied into a private device buffer; its handle completes with the copy) and
// handed to NCCL, in one group, with the next operation this process issues on the same
// communicator — typically the matching recv, which makes "everyone sends, then receives"
// safe. Tags must therefore pair up in program order on both sides. Do not block on another
// library (an MPI barrier, say) right after a send with no NCCL call on that communicator in
// between: the peer's recv would wait for it.
//
// Errors: tessera::Error("nccl: ncclAllReduce on group 'tp' failed on rank 1: ...").
#pragma once

#include "parallel/comm/communicator.h"

namespace tessera::parallel {

// An NCCL communicator over the ranks of `bootstrap` (an MPI or threads communicator, CPU):
// rank 0's ncclUniqueId travels through bootstrap->broadcast. Each rank uses CUDA device
// `device`, or (device < 0) its local rank on this host modulo the visible device count.
// Named like the bootstrap ("world"); backend "nccl". Collective over bootstrap.
CommPtr nccl_world(const CommPtr& bootstrap, int device = -1);

}  // namespace tessera::parallel
