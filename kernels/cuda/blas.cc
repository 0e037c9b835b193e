// Library handles, workspaces and status checks of cuBLASLt and cuDNN (see blas.h).
#include "kernels/cuda/blas.h"

#include <array>
#include <mutex>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "tensor/error.h"

namespace tessera::cuda_kernels {
namespace {

constexpr int kMaxDevices = 64;
// cuBLASLt's recommended workspace on Hopper (PyTorch uses the same).
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;

std::mutex& handles_mutex() {
  static std::mutex mu;
  return mu;
}

void check_device(Device d) {
  TS_CHECK(d.is_cuda() && d.index >= 0 && d.index < kMaxDevices, "cuda: bad device {}", d);
}

}  // namespace

void cublas_check(cublasStatus_t s, std::string_view op, std::string_view what, Device d) {
  if (s != CUBLAS_STATUS_SUCCESS) [[unlikely]] {
    fail("{}: {} on {} failed: {} ({})", op, what, d, cublasLtGetStatusName(s),
         cublasLtGetStatusString(s));
  }
}

void cudnn_check(cudnnStatus_t s, std::string_view op, std::string_view what, Device d) {
  if (s != CUDNN_STATUS_SUCCESS) [[unlikely]] {
    fail("{}: {} on {} failed: {}", op, what, d, cudnnGetErrorString(s));
  }
}

cublasLtHandle_t cublaslt_handle(Device d) {
  static std::array<cublasLtHandle_t, kMaxDevices> handles{};
  check_device(d);
  std::lock_guard<std::mutex> lock(handles_mutex());
  if (handles[d.index] == nullptr) {
    DeviceGuard g(d);
    cublas_check(cublasLtCreate(&handles[d.index]), "matmul", "cublasLtCreate", d);
  }
  return handles[d.index];
}

Workspace lt_workspace(Device d) {
  // Raw cudaMalloc rather than a Tensor: it lives as long as the process (never freed, so
  // no ordering issue with the caching allocator's teardown at exit).
  static std::array<void*, kMaxDevices> buffers{};
  check_device(d);
  std::lock_guard<std::mutex> lock(handles_mutex());
  if (buffers[d.index] == nullptr) {
    DeviceGuard g(d);
    cuda_check(cudaMalloc(&buffers[d.index], kLtWorkspaceBytes), "cudaMalloc (cuBLASLt workspace)", d);
  }
  return {buffers[d.index], kLtWorkspaceBytes};
}

namespace {
std::array<std::vector<cudnnHandle_t>, kMaxDevices>& cudnn_pool() {
  static auto* pool = new std::array<std::vector<cudnnHandle_t>, kMaxDevices>();
  return *pool;
}
}  // namespace

CudnnLease::CudnnLease(Device d) : device_(d) {
  check_device(d);
  {
    std::lock_guard<std::mutex> lock(handles_mutex());
    auto& free = cudnn_pool()[d.index];
    if (!free.empty()) {
      handle_ = free.back();
      free.pop_back();
    }
  }
  if (handle_ == nullptr) cudnn_check(cudnnCreate(&handle_), "conv2d", "cudnnCreate", d);
  const cudnnStatus_t s = cudnnSetStream(handle_, compute_stream(d));
  if (s != CUDNN_STATUS_SUCCESS) {
    std::lock_guard<std::mutex> lock(handles_mutex());
    cudnn_pool()[d.index].push_back(handle_);
    cudnn_check(s, "conv2d", "cudnnSetStream", d);
  }
}

CudnnLease::~CudnnLease() {
  std::lock_guard<std::mutex> lock(handles_mutex());
  cudnn_pool()[device_.index].push_back(handle_);
}

}  // namespace tessera::cuda_kernels
