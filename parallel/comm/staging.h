// Device tensors through a CPU backend (threads, MPI): the collective runs on host copies.
// The input is copied to the host when the collective is issued (after the device's queued
// work, so it sees what the caller computed); the result is copied back into the device
// tensor by the handle's wait() (or is_completed() once done), queued on the device's
// compute stream, so later kernels see it. This lets several ranks share one GPU (NCCL
// refuses two ranks on one device) at the price of two copies per collective.
//
// The Communicator base (communicator.cc) does it once for every backend whose
// stages_device_tensors() is true:
//   if (internal::off_host(t)) {                         // in Communicator::all_reduce_async
//     const Tensor h = internal::host_copy(t);
//     return internal::copy_back(do_all_reduce(h, op), t, h);
//   }
#pragma once

#include "parallel/comm/communicator.h"

namespace tessera::parallel::internal {

// True when t is not in host memory, so a CPU backend must stage it.
inline bool off_host(const Tensor& t) { return !t.device().is_cpu(); }

// A contiguous host copy of t's values; returns once they arrived.
Tensor host_copy(const Tensor& t);
// Uninitialised contiguous host memory shaped like t (for results).
Tensor host_buffer(const Tensor& t);

// A handle that waits for `inner` (a collective on host buffers), then copies `host` into
// `device` (nothing to copy when `device` is undefined: a broadcast's root, say). Waits and
// copies once; an error of `inner` is rethrown by every wait() and nothing is copied.
WorkHandle copy_back(WorkHandle inner, Tensor device, Tensor host);

}  // namespace tessera::parallel::internal
