// CUDA kernels of the reductions sum, mean, max, argmax and var (device code: reduce.cu).
//
//   Tensor s = sum(x.to(cuda(0)), {0, 2}, true);   // any dims, keepdim
//
// The input is described as [kept dims..., reduced dims...] (each group coalesced, as the
// CPU's reduce.cc does). Layouts the kernels cannot read directly (neither the reduced run
// nor the innermost kept dim contiguous) are first packed with the reduced dims last, one
// device copy, so the reduction then reads contiguous rows.
#include <algorithm>

#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

// Appends (size, stride) to a group, dropping size-1 dims and merging with the previous dim
// when the two are contiguous with each other (keeps the group's linear order).
void push_dim(int& n, int64_t* sizes, int64_t* strides, int64_t size, int64_t stride) {
  if (size == 1) return;
  if (n > 0 && strides[n - 1] == stride * size) {
    sizes[n - 1] *= size;
    strides[n - 1] = stride;
    return;
  }
  sizes[n] = size;
  strides[n] = stride;
  ++n;
}

ReduceLayout make_layout(const Tensor& x, const std::vector<int64_t>& rdims) {
  ReduceLayout l;
  std::vector<bool> reduced(static_cast<size_t>(x.dim()), false);
  for (int64_t d : rdims) reduced[d] = true;
  for (int64_t d = 0; d < x.dim(); ++d) {
    const int64_t size = x.shape()[d], stride = x.strides()[d];
    if (reduced[d]) {
      l.nr *= size;
      push_dim(l.nred, l.rsizes, l.rstrides, size, stride);
    } else {
      l.nk *= size;
      push_dim(l.nkept, l.ksizes, l.kstrides, size, stride);
    }
  }
  return l;
}

// x with the kept dims first and the reduced dims last, contiguous (one copy on the device).
Tensor pack_reduced_last(const Tensor& x, const std::vector<int64_t>& rdims) {
  std::vector<bool> reduced(static_cast<size_t>(x.dim()), false);
  for (int64_t d : rdims) reduced[d] = true;
  Shape shape;
  Strides strides;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (reduced[d] != (pass == 1)) continue;
      shape.push_back(x.shape()[d]);
      strides.push_back(x.strides()[d]);
    }
  }
  // A view built directly (not through permute) so that no autograd node is recorded.
  const Tensor view = Tensor::from_storage(x.storage(), shape, strides, x.offset(), x.dtype());
  Tensor packed = Tensor::empty(shape, x.dtype(), x.device());
  copy_cuda(packed, view);
  return packed;
}

void reduce(ReduceOp op, std::string_view name, const Tensor& input, const Tensor& out,
            const std::vector<int64_t>& rdims, int64_t correction) {
  if (out.numel() == 0) return;
  TS_CHECK(input.dim() <= kMaxDims, "{}: input {} has {} dims; the CUDA kernels take at most {}",
           name, shape_str(input.shape()), input.dim(), kMaxDims);
  const Device device = out.device();
  DeviceGuard g(device);
  Tensor x = input;
  ReduceLayout l = make_layout(x, rdims);
  if (!reduce_direct(l)) {
    x = pack_reduced_last(x, rdims);
    std::vector<int64_t> last(rdims.size());
    for (size_t i = 0; i < rdims.size(); ++i) last[i] = x.dim() - static_cast<int64_t>(rdims.size() - i);
    l = make_layout(x, last);
  }
  const int64_t ws_bytes = reduce_workspace_bytes(l);
  const Tensor ws = ws_bytes > 0 ? Tensor::empty({ws_bytes}, DType::b8, device) : Tensor();
  void* ws_ptr = ws_bytes > 0 ? ws.raw_data() : nullptr;
  const DevTensor o = dev_tensor(out), in = dev_tensor(x);
  run_launch(name, device, [&] {
    launch_reduce(op, o, in, l, correction, ws_ptr, compute_stream(device));
  });
}

template <OpId id, ReduceOp op>
void reduce_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  reduce(op, op_name(id), in[0], out[0], normalize_dims(op_name(id), a.dims, in[0].dim()),
         a.correction);
}

void argmax_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor& x = in[0];
  std::vector<int64_t> dims;
  if (a.all_dims) {
    for (int64_t d = 0; d < x.dim(); ++d) dims.push_back(d);
  } else if (x.dim() > 0) {
    dims.push_back(normalize_dim("argmax", a.dim, x.dim()));
  }
  reduce(ReduceOp::argmax, "argmax", x, out[0], dims, 0);
}

// Strided tensors are first copied contiguous (one device copy each); one workspace for the
// per-tensor sums and every tensor's block sums.
void sum_squares_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Device device = out[0].device();
  DeviceGuard g(device);
  std::vector<Tensor> keep;
  std::vector<DevTensor> xs;
  int64_t blocks = 1;
  for (const Tensor& x : in) {
    Tensor c = x;
    if (!x.is_contiguous()) {
      c = Tensor::empty(x.shape(), x.dtype(), device);
      copy_cuda(c, x);
    }
    keep.push_back(c);
    // As a flat run of elements (any number of dims).
    xs.push_back(dev_tensor(Tensor::from_storage(c.storage(), {c.numel()}, {1}, c.offset(), c.dtype())));
    blocks += squares_blocks(x.numel());
  }
  const Tensor ws = Tensor::empty({static_cast<int64_t>(in.size()) + blocks}, DType::f64, device);
  double* sums = static_cast<double*>(ws.raw_data());
  const DevTensor o = dev_tensor(out[0]);
  run_launch("sum_squares", device, [&] {
    launch_sum_squares(o, xs, sums, sums + in.size(), compute_stream(device));
  });
}

TS_REGISTER_KERNEL(cuda, sum, (reduce_kernel<OpId::sum, ReduceOp::sum>));
TS_REGISTER_KERNEL(cuda, sum_squares, sum_squares_kernel);
TS_REGISTER_KERNEL(cuda, mean, (reduce_kernel<OpId::mean, ReduceOp::mean>));
TS_REGISTER_KERNEL(cuda, max, (reduce_kernel<OpId::max, ReduceOp::max>));
TS_REGISTER_KERNEL(cuda, var, (reduce_kernel<OpId::var, ReduceOp::var>));
TS_REGISTER_KERNEL(cuda, argmax, argmax_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
