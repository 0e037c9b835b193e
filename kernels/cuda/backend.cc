// The CUDA backend's slot in the core, built only under --config=cuda: an allocator per
// device and the kernels that move bytes (to_device, copy_, clone, cast, full). Every other
// op's CUDA kernel registers the same way, against the same op list.
//
//   Tensor g = randn({1024, 1024}).to(cuda(0));   // H2D through the to_device kernel
//   Tensor h = g.to(kCPU);                          // D2H
#include <cuda_runtime.h>

#include <array>
#include <mutex>

#include "kernels/cpu/util.h"
#include "kernels/cuda/copy_kernels.cuh"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

void check(cudaError_t e, const char* what, Device d) {
  if (e != cudaSuccess) fail("cuda: {} on {} failed: {}", what, d, cudaGetErrorString(e));
}

// Plain cudaMalloc/cudaFree with counters; the caching allocator replaces it with the full
// CUDA backend.
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(Device d) : device_(d) {}
  void* allocate(int64_t nbytes) override {
    void* p = nullptr;
    check(cudaSetDevice(device_.index), "cudaSetDevice", device_);
    if (nbytes > 0) check(cudaMalloc(&p, static_cast<size_t>(nbytes)), "cudaMalloc", device_);
    tracker_.add(nbytes);
    return p;
  }
  void deallocate(void* ptr, int64_t nbytes) override {
    if (ptr != nullptr) cudaFree(ptr);
    tracker_.sub(nbytes);
  }
  MemoryStats stats() const override {
    return MemoryStats{tracker_.current(), tracker_.peak(), tracker_.current(), tracker_.count()};
  }
  void reset_peak() override { tracker_.reset_peak(); }

 private:
  Device device_;
  MemoryTracker tracker_;
};

Allocator& allocator_for_device(Device d) {
  static std::array<CudaAllocator*, 64> allocators{};
  static std::mutex mu;
  TS_CHECK(d.index >= 0 && d.index < 64, "cuda: device index {} out of range", d.index);
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount", d);
  TS_CHECK(d.index < count, "cuda: {} requested but {} CUDA device(s) are visible", d, count);
  std::lock_guard<std::mutex> lock(mu);
  if (allocators[d.index] == nullptr) allocators[d.index] = new CudaAllocator(d);
  return *allocators[d.index];
}

const bool kAllocatorRegistered = (register_allocator(DeviceType::cuda, &allocator_for_device), true);

Strides src_strides_for(const Tensor& dst, const Tensor& src) {
  return broadcast_strides(src.shape(), src.strides(), dst.shape());
}

void device_strided_copy(const Tensor& dst, const Tensor& src) {
  TS_CHECK(dst.dim() <= kMaxDims, "cuda copy: {} dims exceed the supported {}", dst.dim(), kMaxDims);
  check(cudaSetDevice(dst.device().index), "cudaSetDevice", dst.device());
  const Strides ss = src_strides_for(dst, src);
  launch_strided_copy(dst.raw_data(), src.raw_data(), static_cast<int>(dst.dim()),
                      dst.shape().data(), dst.strides().data(), ss.data(), dst.numel(),
                      static_cast<int>(dtype_size(dst.dtype())));
}

// Copies src into dst (same shape after broadcasting, any dtypes, at least one on CUDA).
// Casts happen on the host for now: bytes are staged through a contiguous host buffer.
void copy_between(const Tensor& dst, const Tensor& src) {
  const Device dd = dst.device(), sd = src.device();
  if (dd.is_cuda() && sd.is_cuda() && dst.dtype() == src.dtype() && dd == sd) {
    device_strided_copy(dst, src);
    check(cudaDeviceSynchronize(), "strided copy", dd);
    return;
  }
  // Host-side view of src, broadcast to dst's shape, in dst's dtype, contiguous.
  Tensor host = Tensor::empty(dst.shape(), dst.dtype(), kCPU);
  if (sd.is_cpu()) {
    cpu::copy_cpu(host, src);
  } else {
    Tensor packed = Tensor::empty(dst.shape(), src.dtype(), sd);  // contiguous on the device
    device_strided_copy(packed, src);
    Tensor raw = Tensor::empty(dst.shape(), src.dtype(), kCPU);
    check(cudaMemcpy(raw.raw_data(), packed.raw_data(), packed.nbytes(), cudaMemcpyDeviceToHost),
          "cudaMemcpy D2H", sd);
    cpu::copy_cpu(host, raw);
  }
  if (dd.is_cpu()) {
    cpu::copy_cpu(dst, host);
    return;
  }
  check(cudaSetDevice(dd.index), "cudaSetDevice", dd);
  if (dst.is_contiguous()) {
    check(cudaMemcpy(dst.raw_data(), host.raw_data(), host.nbytes(), cudaMemcpyHostToDevice),
          "cudaMemcpy H2D", dd);
    return;
  }
  Tensor staged = Tensor::empty(dst.shape(), dst.dtype(), dd);
  check(cudaMemcpy(staged.raw_data(), host.raw_data(), host.nbytes(), cudaMemcpyHostToDevice),
        "cudaMemcpy H2D", dd);
  device_strided_copy(dst, staged);
  check(cudaDeviceSynchronize(), "strided copy", dd);
}

void copy_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  copy_between(out[0], in[1]);
}

void copy_input_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  copy_between(out[0], in[0]);
}

void full_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  Tensor one = Tensor::empty({}, out[0].dtype(), kCPU);
  Tensor value = Tensor::empty({}, DType::f64, kCPU);
  *static_cast<double*>(value.raw_data()) = a.value;
  cpu::copy_cpu(one, value);
  check(cudaSetDevice(out[0].device().index), "cudaSetDevice", out[0].device());
  launch_fill(out[0].raw_data(), one.raw_data(), out[0].numel(),
              static_cast<int>(dtype_size(out[0].dtype())));
  check(cudaDeviceSynchronize(), "fill", out[0].device());
}

TS_REGISTER_KERNEL(cuda, copy_, copy_kernel);
TS_REGISTER_KERNEL(cuda, to_device, copy_input_kernel);
TS_REGISTER_KERNEL(cuda, clone, copy_input_kernel);
TS_REGISTER_KERNEL(cuda, cast, copy_input_kernel);
TS_REGISTER_KERNEL(cuda, full, full_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
