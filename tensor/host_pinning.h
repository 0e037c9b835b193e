// How a device backend pins the host tier's blocks (tensor/allocator.h: host_tier_allocator())
// for DMA. The CUDA backend registers cudaHostRegister / cudaHostUnregister when a GPU is
// present, so copies of offloaded state between the device and the host tier go straight to
// and from those blocks (kernels/cuda/runtime.cc) instead of through its staging buffers.
//
//   register_host_pinning({.pin = [](void* p, int64_t n) { ... }, .unpin = ...});
#pragma once

#include <cstdint>
#include <functional>

namespace tessera {

struct HostPinning {
  std::function<void(void*, int64_t)> pin;    // a new host-tier block (best effort)
  std::function<void(void*, int64_t)> unpin;  // before the block goes back to the system
};

// Blocks the host tier allocates from now on are pinned (earlier ones stay as they are).
void register_host_pinning(HostPinning pinning);

}  // namespace tessera
