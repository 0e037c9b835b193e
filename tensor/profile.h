// An optional observer of every kernel call(), for per-op profiles. The CUDA backend installs
// one when TESSERA_PROFILE is set (kernels/cuda/profile.cc): it times each op's kernels on
// the device with events and prints a table per op at exit.
//
//   TESSERA_PROFILE=3 ./gpt --device=cuda ...   # profile from the 4th optimizer step on
#pragma once

#include "tensor/device.h"
#include "tensor/op.h"

namespace tessera {

// begin == true just before the kernel of `op` runs on `device`, false just after.
using KernelObserver = void (*)(OpId op, Device device, bool begin);
void set_kernel_observer(KernelObserver observer);
KernelObserver kernel_observer();

}  // namespace tessera
