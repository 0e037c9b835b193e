// Host glue of the fused nn ops on CUDA (softmax, log_softmax, layer_norm, layer_norm_backward,
// cross_entropy, cross_entropy_backward): makes inputs contiguous, allocates workspaces from
// the caching allocator and launches nn.cu's kernels on the compute stream. The CPU kernels
// (kernels/cpu/softmax.cc, norm.cc, loss.cc) are the spec.
//
// Bad cross_entropy targets are found on the device; they throw at a later index-reading op
// on the device (see index.cuh), not at this call, because the host never waits here.
#include "kernels/cuda/index.cuh"
#include "kernels/cuda/nn.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

DevTensor optional_dev(const Tensor& t) { return t.defined() ? dev_tensor(t) : DevTensor{}; }

Tensor workspace(int64_t bytes, Device d) {
  return Tensor::empty({std::max<int64_t>(bytes, 1)}, DType::b8, d);
}

template <bool kLog>
void softmax_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const char* op = kLog ? "log_softmax" : "softmax";
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const Tensor x = contiguous_cuda(in[0]);
  const int64_t dim = normalize_dim(op, a.dim, x.dim());
  int64_t outer = 1, inner = 1;
  const int64_t n = x.dim() == 0 ? 1 : x.shape()[dim];
  for (int64_t i = 0; i < dim; ++i) outer *= x.shape()[i];
  for (int64_t i = dim + 1; i < x.dim(); ++i) inner *= x.shape()[i];
  const DevTensor xd = dev_tensor(x), yd = dev_tensor(out[0]);
  run_launch(op, d, [&] { launch_softmax(yd, xd, outer, n, inner, kLog, compute_stream(d)); });
}

void layer_norm_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const Tensor x = contiguous_cuda(in[0]);
  const Tensor w = in[1].defined() ? contiguous_cuda(in[1]) : Tensor();
  const Tensor b = in[2].defined() ? contiguous_cuda(in[2]) : Tensor();
  int64_t cols = 1;
  for (int64_t i = x.dim() - a.normalized_ndim; i < x.dim(); ++i) cols *= x.shape()[i];
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const DevTensor yd = dev_tensor(out[0]), md = dev_tensor(out[1]), rd = dev_tensor(out[2]);
  const DevTensor xd = dev_tensor(x), wd = optional_dev(w), bd = optional_dev(b);
  run_launch("layer_norm", d, [&] {
    launch_layer_norm(yd, md, rd, xd, wd, bd, rows, cols, a.eps, compute_stream(d));
  });
}

// Inputs: x, r, weight, bias. Outputs: s = x + r, layer_norm(s), mean, rstd.
void add_layer_norm_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const Tensor x = contiguous_cuda(in[0]), r = contiguous_cuda(in[1]);
  const Tensor w = in[2].defined() ? contiguous_cuda(in[2]) : Tensor();
  const Tensor b = in[3].defined() ? contiguous_cuda(in[3]) : Tensor();
  int64_t cols = 1;
  for (int64_t i = x.dim() - a.normalized_ndim; i < x.dim(); ++i) cols *= x.shape()[i];
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const DevTensor sd = dev_tensor(out[0]), yd = dev_tensor(out[1]), md = dev_tensor(out[2]),
                  rd = dev_tensor(out[3]);
  const DevTensor xd = dev_tensor(x), resd = dev_tensor(r), wd = optional_dev(w), bd = optional_dev(b);
  run_launch("add_layer_norm", d, [&] {
    launch_layer_norm(yd, md, rd, xd, wd, bd, rows, cols, a.eps, compute_stream(d), resd, sd);
  });
}

// Inputs: grad, x, mean, rstd, weight, bias[, residual_grad]. Outputs: grad_x, grad_weight,
// grad_bias.
void layer_norm_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                const Attrs& a) {
  const Device d = in[1].device();
  DeviceGuard guard(d);
  const Tensor g = contiguous_cuda(in[0]), x = contiguous_cuda(in[1]);
  const Tensor mean = contiguous_cuda(in[2]), rstd = contiguous_cuda(in[3]);
  const Tensor w = in[4].defined() ? contiguous_cuda(in[4]) : Tensor();
  const Tensor res = in.size() > 6 && in[6].defined() ? contiguous_cuda(in[6]) : Tensor();
  int64_t cols = 1;
  for (int64_t i = x.dim() - a.normalized_ndim; i < x.dim(); ++i) cols *= x.shape()[i];
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const bool want_w = out.size() > 1 && out[1].defined();
  const bool want_b = out.size() > 2 && out[2].defined();
  const Tensor ws = workspace(
      layer_norm_backward_workspace_bytes(rows, cols, static_cast<int>(x.dtype()), want_w, want_b), d);
  const DevTensor dxd = dev_tensor(out[0]);
  const DevTensor dwd = want_w ? dev_tensor(out[1]) : DevTensor{};
  const DevTensor dbd = want_b ? dev_tensor(out[2]) : DevTensor{};
  const DevTensor gd = dev_tensor(g), xd = dev_tensor(x), md = dev_tensor(mean),
                  rd = dev_tensor(rstd), wd = optional_dev(w);
  run_launch("layer_norm_backward", d, [&] {
    launch_layer_norm_backward(dxd, dwd, dbd, gd, xd, md, rd, wd, rows, cols, ws.raw_data(),
                               compute_stream(d), optional_dev(res));
  });
}

void cross_entropy_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor logits = contiguous_cuda(in[0]), target = contiguous_cuda(in[1]);
  const Tensor ws = workspace(cross_entropy_workspace_bytes(logits.shape()[0]), d);
  const DevTensor ld = dev_tensor(out[0]), sd = dev_tensor(out[1]);
  const DevTensor xd = dev_tensor(logits), td = dev_tensor(target);
  const cudaStream_t s = compute_stream(d);
  run_launch("cross_entropy", d, [&] {
    launch_cross_entropy(ld, sd, xd, td, static_cast<int>(a.reduction), a.ignore_index,
                         ws.raw_data(), device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

// Inputs: grad, logits, target, logsumexp.
void cross_entropy_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out,
                                   const Attrs& a) {
  const Device d = in[1].device();
  DeviceGuard guard(d);
  poll_device_errors(d.index);
  const Tensor g = contiguous_cuda(in[0]), logits = contiguous_cuda(in[1]);
  const Tensor target = contiguous_cuda(in[2]), lse = contiguous_cuda(in[3]);
  const Tensor ws = workspace(cross_entropy_workspace_bytes(1), d);
  const DevTensor dxd = dev_tensor(out[0]), gd = dev_tensor(g), xd = dev_tensor(logits),
                  td = dev_tensor(target), sd = dev_tensor(lse);
  const cudaStream_t s = compute_stream(d);
  run_launch("cross_entropy_backward", d, [&] {
    launch_cross_entropy_backward(dxd, gd, xd, td, sd, static_cast<int>(a.reduction),
                                  a.ignore_index, ws.raw_data(), device_error_record(d.index), s);
  });
  queue_device_error_check(d.index, s);
}

TS_REGISTER_KERNEL(cuda, softmax, softmax_kernel<false>);
TS_REGISTER_KERNEL(cuda, log_softmax, softmax_kernel<true>);
TS_REGISTER_KERNEL(cuda, layer_norm, layer_norm_kernel);
TS_REGISTER_KERNEL(cuda, layer_norm_backward, layer_norm_backward_kernel);
TS_REGISTER_KERNEL(cuda, add_layer_norm, add_layer_norm_kernel);
TS_REGISTER_KERNEL(cuda, cross_entropy, cross_entropy_kernel);
TS_REGISTER_KERNEL(cuda, cross_entropy_backward, cross_entropy_backward_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
