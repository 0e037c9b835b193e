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

// A device backend's asynchronous copy of `nbytes` from device memory `src` (in the block
// that starts at `block`, on device `index`) into the pinned host block `dst`: queued after
// the work the device has queued so far, on a stream beside its compute, the device block
// kept from reuse until the copy is done (ZeRO-Offload's gradient shards leave the device
// while backward goes on). Returns what waits for the bytes to arrive (call it once), or
// nullptr when they cannot move so (`dst` not pinned): the caller copies as usual.
using AsyncToHost = std::function<std::function<void()>(void* dst, const void* src, int64_t nbytes,
                                                        int index, void* block)>;
// One per device type (0: CPU has none, 1: CUDA); an empty function removes it.
void register_async_to_host(int device_type, AsyncToHost copy);
AsyncToHost async_to_host(int device_type);

}  // namespace tessera
