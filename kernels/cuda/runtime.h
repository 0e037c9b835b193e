// The CUDA backend's host side: error checks, the compute and communication streams, the
// caching allocator's statistics, staged host<->device copies, and the bridge from Tensor
// to the plain DevTensor that .cu launchers take. Built only under --config=cuda.
//
//   DeviceGuard g(t.device());                  // cudaSetDevice for this scope
//   cudaStream_t s = compute_stream(t.device());
//   launch_something(dev_tensor(out), dev_tensor(in), s);
//   cuda_check(cudaGetLastError(), "something", t.device());
//
// Streams: every kernel runs on the device's compute stream (the legacy default stream, so
// synchronous CUDA calls and host code that reads results stay ordered with it). Collectives
// run on a communication stream per device (NCCL); events order the two (stream_wait).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string_view>

#include "kernels/cuda/dev_tensor.h"
#include "tensor/allocator.h"
#include "tensor/tensor.h"

namespace tessera::cuda_kernels {

// Throws tessera::Error "cuda: <what> on cuda:N failed: <CUDA's message>".
void cuda_check(cudaError_t e, std::string_view what, Device d);
// Runs `launch` (a .cu launcher that may throw CudaLaunchError) and checks the launch,
// turning any failure into tessera::Error naming `op` and the device.
void run_launch(std::string_view op, Device d, const std::function<void()>& launch);

class DeviceGuard {
 public:
  explicit DeviceGuard(Device d);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

int device_count();
cudaStream_t compute_stream(Device d);
cudaStream_t comm_stream(Device d);
// Makes `waiter` wait for everything queued so far on `signaller` (an event between them).
void stream_wait(cudaStream_t waiter, cudaStream_t signaller, Device d);
// Host waits for the device's compute stream.
void synchronize(Device d);

// The caching allocator of device d (also reachable as allocator_for(cuda(d))).
struct CachingStats {
  int64_t allocated_bytes = 0, peak_allocated_bytes = 0;
  int64_t reserved_bytes = 0, peak_reserved_bytes = 0;
  int64_t num_allocs = 0, num_cuda_mallocs = 0, num_cache_hits = 0, num_frees_to_system = 0;
};
CachingStats caching_stats(Device d);
void empty_cache(Device d);
// The block holding `ptr` is also used by `stream`: when freed it is reused only after the
// work queued on `stream` by then has finished (PyTorch's record_stream).
void record_stream(Device d, void* ptr, cudaStream_t stream);

// Copies between host memory and device memory through pinned staging buffers (chunked and
// double-buffered), on the compute stream. to_host returns after the bytes have arrived.
void copy_to_device(void* dst, const void* src, int64_t nbytes, Device d);
void copy_to_host(void* dst, const void* src, int64_t nbytes, Device d);

// The kernel's view of a tensor (up to kMaxDims dims); Error beyond that.
DevTensor dev_tensor(const Tensor& t);
// dev_tensor of `t` broadcast to `shape` (strides 0 on expanded dims).
DevTensor dev_tensor_broadcast(const Tensor& t, const Shape& shape);
// `t` itself when contiguous, else a contiguous copy on its device (compute stream).
Tensor contiguous_cuda(const Tensor& t);
// dst <- src (same device; src broadcast to dst's shape; any dtypes, casting like the CPU).
void copy_cuda(const Tensor& dst, const Tensor& src);

// TF32 for f32 matrix products (cuBLASLt) and convolutions: off unless set (or the
// environment variable TESSERA_ALLOW_TF32=1).
void set_allow_tf32(bool allow);
bool allow_tf32();

// Whether large 16-bit matmuls whose matrices are not 16-byte aligned (a leading dimension
// not a multiple of 8) run on aligned staged copies (kernels/cuda/matmul.cc): on unless set
// off (or the environment variable TESSERA_CUDA_STAGE_UNALIGNED=0).
void set_stage_unaligned_gemms(bool on);
bool stage_unaligned_gemms();
// How many matmuls have run staged so far in this process (tests assert the path ran).
int64_t staged_gemm_count();

}  // namespace tessera::cuda_kernels
