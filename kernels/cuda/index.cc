// Host glue of the indexing ops on CUDA (embedding, index_select, index_add, gather,
// scatter_add) and cat, plus the per-device record of bad indices (index.cuh): kernels record
// the first out-of-range index, a copy of the record is queued to pinned host memory after
// each index-reading op, and the next such op on the device throws tessera::Error naming the
// offending op, index and size once that copy has landed (a host that synchronises in
// between, e.g. by reading a result, is sure to see it at the following op).
#include <array>
#include <mutex>

#include "kernels/cpu/util.h"
#include "kernels/cuda/index.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {

namespace {

struct ErrorState {
  std::mutex mu;
  DeviceErrorRecord* dev = nullptr;
  DeviceErrorRecord* host = nullptr;  // pinned
  cudaEvent_t landed = nullptr;
  bool pending = false;
};

constexpr int kMaxDevices = 64;

ErrorState& error_state(int device) {
  static std::array<ErrorState, kMaxDevices> states;
  TS_CHECK(device >= 0 && device < kMaxDevices, "cuda: device index {} out of range", device);
  return states[device];
}

// Caller holds st.mu and has the device set.
void init_state(ErrorState& st, int device) {
  if (st.dev != nullptr) return;
  const Device d = cuda(device);
  cuda_check(cudaMalloc(&st.dev, sizeof(DeviceErrorRecord)), "cudaMalloc (index error record)", d);
  cuda_check(cudaMemset(st.dev, 0, sizeof(DeviceErrorRecord)), "cudaMemset", d);
  cuda_check(cudaMallocHost(&st.host, sizeof(DeviceErrorRecord)), "cudaMallocHost", d);
  *st.host = DeviceErrorRecord{};
  cuda_check(cudaEventCreateWithFlags(&st.landed, cudaEventDisableTiming), "cudaEventCreate", d);
}

const char* error_op_name(int op) {
  switch (op) {
    case kErrEmbedding: return "embedding";
    case kErrIndexSelect: return "index_select";
    case kErrIndexAdd: return "index_add";
    case kErrGather: return "gather";
    case kErrScatterAdd: return "scatter_add";
    case kErrCrossEntropy: return "cross_entropy";
    case kErrCrossEntropyBackward: return "cross_entropy_backward";
    case kErrMaxPoolBackward: return "max_pool2d_backward";
    default: return "an indexing op";
  }
}

}  // namespace

DeviceErrorRecord* device_error_record(int device) {
  ErrorState& st = error_state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  init_state(st, device);
  return st.dev;
}

void poll_device_errors(int device) {
  ErrorState& st = error_state(device);
  DeviceErrorRecord rec{};
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (!st.pending || cudaEventQuery(st.landed) != cudaSuccess) return;
    st.pending = false;
    if (st.host->flag == 0) return;
    rec = *st.host;
    *st.host = DeviceErrorRecord{};
    cuda_check(cudaMemsetAsync(st.dev, 0, sizeof(DeviceErrorRecord), compute_stream(cuda(device))),
               "cudaMemsetAsync (index error record)", cuda(device));
  }
  const char* op = error_op_name(rec.op);
  const char* where = "(found on the device by an earlier launch; reported at the next indexing op)";
  if (rec.op == kErrCrossEntropy || rec.op == kErrCrossEntropyBackward) {
    fail("{}: target {} at row {} is out of range for {} classes on cuda:{} {}", op, rec.index,
         rec.dim, rec.size, device, where);
  }
  if (rec.op == kErrMaxPoolBackward) {
    fail("{}: index {} is out of range (or outside its window) for input planes of {} elements "
         "on cuda:{} {}", op, rec.index, rec.size, device, where);
  }
  fail("{}: index {} is out of range for dim {} of size {} on cuda:{} {}", op, rec.index, rec.dim,
       rec.size, device, where);
}

void queue_device_error_check(int device, cudaStream_t stream) {
  ErrorState& st = error_state(device);
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.pending || st.dev == nullptr) return;
  const Device d = cuda(device);
  cuda_check(cudaMemcpyAsync(st.host, st.dev, sizeof(DeviceErrorRecord), cudaMemcpyDeviceToHost,
                             stream), "cudaMemcpyAsync (index error record)", d);
  cuda_check(cudaEventRecord(st.landed, stream), "cudaEventRecord", d);
  st.pending = true;
}

namespace {

using cpu::Split3;
using cpu::split3;

void embedding_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor w = contiguous_cuda(in[0]), idx = contiguous_cuda(in[1]);
  const DevTensor od = dev_tensor(out[0]), wd = dev_tensor(w), id = dev_tensor(idx);
  const cudaStream_t s = compute_stream(d);
  run_launch("embedding", d, [&] { launch_embedding(od, wd, id, device_error_record(d.index), s); });
  queue_device_error_check(d.index, s);
}

void index_select_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor x = contiguous_cuda(in[0]), idx = contiguous_cuda(in[1]);
  const int64_t dim = normalize_dim("index_select", a.dim, x.dim());
  const Split3 sp = split3(x.shape(), dim);
  const DevTensor od = dev_tensor(out[0]), xd = dev_tensor(x), id = dev_tensor(idx);
  const cudaStream_t s = compute_stream(d);
  run_launch("index_select", d, [&] {
    launch_index_select(od, xd, id, sp.outer, sp.mid, sp.inner, dim, device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

// out = x, then source's slices added at index along dim (launch_index_add's sorted runs).
void index_add_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor& o = out[0];
  copy_cuda(o, in[0]);
  const Tensor idx = contiguous_cuda(in[1]), src = contiguous_cuda(in[2]);
  const int64_t dim = normalize_dim("index_add", a.dim, o.dim());
  const Split3 sp = split3(o.shape(), dim);
  const Tensor ws = Tensor::empty({std::max<int64_t>(1, index_add_workspace_bytes(idx.numel()))},
                                  DType::b8, d);
  const DevTensor od = dev_tensor(o), sd = dev_tensor(src), id = dev_tensor(idx);
  const cudaStream_t s = compute_stream(d);
  run_launch("index_add", d, [&] {
    launch_index_add(od, sd, id, sp.outer, sp.mid, sp.inner, dim, ws.raw_data(),
                     device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

void gather_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const int64_t dim = normalize_dim("gather", a.dim, in[0].dim());
  const DevTensor od = dev_tensor(out[0]), xd = dev_tensor(in[0]), id = dev_tensor(in[1]);
  const cudaStream_t s = compute_stream(d);
  run_launch("gather", d, [&] {
    launch_gather(od, xd, id, static_cast<int>(dim), device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

void scatter_add_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor& o = out[0];
  copy_cuda(o, in[0]);
  const int64_t dim = normalize_dim("scatter_add", a.dim, o.dim());
  const DevTensor od = dev_tensor(o), sd = dev_tensor(in[2]), id = dev_tensor(in[1]);
  const cudaStream_t s = compute_stream(d);
  run_launch("scatter_add", d, [&] {
    launch_scatter_add(od, sd, id, static_cast<int>(dim), device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

// One copy per input into its slice of the output (copy_cuda: one kernel or memcpy each).
void cat_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& o = out[0];
  DeviceGuard guard(o.device());
  const int64_t d = normalize_dim("cat", a.dim, o.dim());
  int64_t start = 0;
  for (const Tensor& t : in) {
    const int64_t len = t.shape()[d];
    if (len == 0) continue;
    Tensor dst = Tensor::from_storage(o.storage(), t.shape(), o.strides(),
                                      o.offset() + start * o.strides()[d], o.dtype());
    copy_cuda(dst, t);
    start += len;
  }
}

TS_REGISTER_KERNEL(cuda, embedding, embedding_kernel);
TS_REGISTER_KERNEL(cuda, index_select, index_select_kernel);
TS_REGISTER_KERNEL(cuda, index_add, index_add_kernel);
TS_REGISTER_KERNEL(cuda, gather, gather_kernel);
TS_REGISTER_KERNEL(cuda, scatter_add, scatter_add_kernel);
TS_REGISTER_KERNEL(cuda, cat, cat_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
