// Library handles of the CUDA backend's matrix products and convolutions: one cuBLASLt
// handle and one 32 MiB cuBLASLt workspace per device, a pool of cuDNN handles per device
// (leased to one thread at a time), and the status checks that turn library failures into
// tessera::Error.
//
//   cublasLtMatmul(cublaslt_handle(d), ..., lt_workspace(d).ptr, lt_workspace(d).bytes,
//                  compute_stream(d));
//   CudnnLease h(d);                                  // bound to compute_stream(d)
//   cudnnConvolutionForward(h.get(), ...);
#pragma once

#include <cublasLt.h>
#include <cudnn.h>

#include <cstddef>
#include <string_view>

#include "tensor/device.h"

namespace tessera::cuda_kernels {

// cuBLASLt's handle of device d, created on first use. Handles are thread-safe to share.
cublasLtHandle_t cublaslt_handle(Device d);

// A device buffer for cuBLASLt's split-K and stream-K algorithms, allocated once per device
// and kept for the process. Matmuls of one device all run on its compute stream, so they
// take turns with it.
struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};
Workspace lt_workspace(Device d);

// A cuDNN handle of device d for this scope, its stream set to compute_stream(d). cuDNN
// handles must not be used by two threads at once, so each lease takes one from the
// device's pool (creating one when all are in use) and gives it back when it ends. Create
// it under a DeviceGuard for d.
class CudnnLease {
 public:
  explicit CudnnLease(Device d);
  ~CudnnLease();
  CudnnLease(const CudnnLease&) = delete;
  CudnnLease& operator=(const CudnnLease&) = delete;
  cudnnHandle_t get() const { return handle_; }

 private:
  Device device_;
  cudnnHandle_t handle_ = nullptr;
};

// Throw tessera::Error "<op>: <what> on cuda:N failed: <library's message>".
void cublas_check(cublasStatus_t s, std::string_view op, std::string_view what, Device d);
void cudnn_check(cudnnStatus_t s, std::string_view op, std::string_view what, Device d);

}  // namespace tessera::cuda_kernels
