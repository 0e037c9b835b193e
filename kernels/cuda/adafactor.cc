// Adafactor's fused passes on CUDA (tensor/ops.h): host glue around adafactor.cu. The
// written operands must be contiguous (the CPU's check and message); the ones only read are
// packed when strided.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/adafactor.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

void require_contiguous(const char* op, const Tensor& t, const char* what) {
  TS_CHECK(!t.defined() || t.is_contiguous(), "{}: {} {} must be contiguous", op, what,
           shape_str(t.shape()));
}

void stats_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  require_contiguous("adafactor_stats_", in[1], "out");
  const Tensor g = contiguous_cuda(in[0]);
  const Device d = g.device();
  DeviceGuard guard(d);
  run_launch("adafactor_stats_", d, [&] {
    launch_adafactor_stats(g.dtype() == DType::f64, g.raw_data(), in[1].raw_data(), g.size(0),
                           g.size(1), g.size(2), a.eps, compute_stream(d));
  });
}

void norm_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const Tensor g = contiguous_cuda(in[0]), ra = contiguous_cuda(in[1]), rb = contiguous_cuda(in[2]);
  const Device d = g.device();
  DeviceGuard guard(d);
  const Tensor rows = Tensor::empty({std::max<int64_t>(g.size(0) * g.size(1), 1)}, DType::f64, d);
  run_launch("adafactor_norm_", d, [&] {
    launch_adafactor_norm(g.dtype() == DType::f64, g.raw_data(), ra.raw_data(), rb.raw_data(),
                          static_cast<double*>(in[3].raw_data()),
                          static_cast<double*>(rows.raw_data()), g.size(0), g.size(1), g.size(2),
                          a.k == 1, a.value, a.eps, compute_stream(d));
  });
}

void apply_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const Tensor m = in.size() > 4 ? in[4] : Tensor();
  require_contiguous("adafactor_apply_", in[0], "param");
  require_contiguous("adafactor_apply_", m, "exp_avg");
  const Tensor g = contiguous_cuda(in[1]), ra = contiguous_cuda(in[2]), rb = contiguous_cuda(in[3]);
  const Device d = g.device();
  DeviceGuard guard(d);
  run_launch("adafactor_apply_", d, [&] {
    launch_adafactor_apply(g.dtype() == DType::f64, in[0].raw_data(), g.raw_data(), ra.raw_data(),
                           rb.raw_data(), m.defined() ? m.raw_data() : nullptr, g.size(0),
                           g.size(1), g.size(2), a.k == 1, a.value, a.eps, a.scale, a.beta1,
                           a.weight_decay, static_cast<int>(a.dim), compute_stream(d));
  });
}

TS_REGISTER_KERNEL(cuda, adafactor_stats_, stats_kernel);
TS_REGISTER_KERNEL(cuda, adafactor_norm_, norm_kernel);
TS_REGISTER_KERNEL(cuda, adafactor_apply_, apply_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
