// The fused optimizer updates on CUDA (adamw_, adamw8bit_, sgd_), single- and multi-tensor
// forms (see tensor/meta_optim.cc): host glue around optim.cu's multi-tensor apply. Same
// semantics and errors as kernels/cpu/optim.cc (the spec): operands of one tuple must not
// overlap; every tuple is checked before any is written. One launch sequence per (param
// dtype, master) among the tuples; non-contiguous operands are packed into temporaries and,
// when written, copied back after the update.
//
// The update's constants are computed here in f64 exactly as the CPU computes them; this
// library is built with -ffp-contract=off (kernels/cuda/BUILD), like kernels/cpu:optim, so
// that -march=native's FMA does not round 1 - lr * weight_decay differently.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/update_checks.h"
#include "kernels/cuda/optim.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"
#include "tensor/quant8.h"

namespace tessera::cuda_kernels {
namespace {

using cpu::check_adamw8bit_operands;
using cpu::check_no_overlap;
using cpu::tuples_of;

static_assert(kAdam8Block == kQuant8Block, "optim.cu's quantization block is tensor/quant8.h's");

// Calls launch(dtype, master, tuples, count) once per (param dtype, has master) found among
// the tuples, each OptimTuple holding the defined operands' contiguous device pointers in
// order. Non-contiguous operands go through temporaries; the written ones are copied back
// after every launch (all on the compute stream, so in order).
template <typename Launch>
void run_grouped(const std::vector<std::span<const Tensor>>& tuples, size_t master_index,
                 std::initializer_list<size_t> written, Launch&& launch) {
  struct Group {
    DType dtype;
    bool master;
    std::vector<OptimTuple> tuples;
  };
  std::vector<Group> groups;
  std::vector<std::pair<Tensor, Tensor>> copy_back;  // (operand, its packed temporary)
  std::vector<Tensor> packed_inputs;                 // alive until the launches are queued
  for (std::span<const Tensor> t : tuples) {
    if (t[0].numel() == 0) continue;
    const bool master = t.size() > master_index && t[master_index].defined();
    OptimTuple ot;
    ot.numel = t[0].numel();
    int slot = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      if (!t[i].defined()) continue;
      Tensor c = t[i];
      if (!c.is_contiguous()) {
        c = contiguous_cuda(t[i]);
        const bool is_written = std::find(written.begin(), written.end(), i) != written.end();
        if (is_written) copy_back.emplace_back(t[i], c);
        else packed_inputs.push_back(c);
      }
      ot.ptr[slot++] = c.raw_data();
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& x) {
      return x.dtype == t[0].dtype() && x.master == master;
    });
    if (g == groups.end()) g = groups.insert(groups.end(), Group{t[0].dtype(), master, {}});
    g->tuples.push_back(ot);
  }
  for (const Group& g : groups) {
    launch(static_cast<int>(g.dtype), g.master, g.tuples.data(),
           static_cast<int64_t>(g.tuples.size()));
  }
  for (const auto& [dst, src] : copy_back) copy_cuda(dst, src);
}

// Inputs: (param, grad, exp_avg, exp_avg_sq[, master]), or k tuples of 5.
void adamw_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 5);
  const size_t count = in.size() < 10 ? 0 : tuples.size();  // 0: the single-tensor form
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("adamw_", j, count, tuples[j],
                     {"param", "grad", "exp_avg", "exp_avg_sq", "master"});
  }
  // The constants exactly as the CPU computes them (in f64, rounded to the state type).
  const double t = static_cast<double>(a.step_count);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
  const AdamWConsts k{1.0 - a.lr * a.weight_decay, 1.0 - a.beta1, a.beta2, 1.0 - a.beta2,
                      std::sqrt(bc2), a.eps, a.lr / bc1, a.grad_scale};
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const cudaStream_t stream = compute_stream(d);
  run_launch("adamw_", d, [&] {
    run_grouped(tuples, 4, {0, 2, 3, 4},
                [&](int dtype, bool master, const OptimTuple* ts, int64_t count) {
                  launch_adamw(dtype, master, ts, count, k, stream);
                });
  });
}

// Inputs: (param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax[, master]),
// or k tuples of 7. Every operand but grad must be contiguous (the CPU's check and message);
// a strided grad is packed.
void adamw8bit_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 7);
  const size_t count = in.size() < 14 ? 0 : tuples.size();  // 0: the single-tensor form
  check_adamw8bit_operands(tuples, count);
  const double t = static_cast<double>(a.step_count);
  const double bc1 = 1.0 - std::pow(a.beta1, t), bc2 = 1.0 - std::pow(a.beta2, t);
  const AdamWConsts k{1.0 - a.lr * a.weight_decay, 1.0 - a.beta1, a.beta2, 1.0 - a.beta2,
                      std::sqrt(bc2), a.eps, a.lr / bc1, a.grad_scale};
  const Quant8Map& q1 = quant8_map(Quant8Kind::signed_dynamic);
  const Quant8Map& q2 = quant8_map(Quant8Kind::unsigned_dynamic);
  const Quant8Maps maps{{q1.values.data(), q2.values.data()},
                        {q1.thresholds.data(), q2.thresholds.data()},
                        {q1.mid64.data(), q2.mid64.data()}};
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const cudaStream_t stream = compute_stream(d);
  run_launch("adamw8bit_", d, [&] {
    // Only grad can be packed (the others are contiguous), so nothing is copied back.
    run_grouped(tuples, 6, {0, 2, 3, 4, 5, 6},
                [&](int dtype, bool master, const OptimTuple* ts, int64_t count) {
                  launch_adamw8bit(dtype, master, ts, count, k, maps, stream);
                });
  });
}

// Inputs: (param, grad, momentum_buffer[, master]), or k tuples of 4; the buffer is defined
// in every tuple or in none (momentum != 0).
void sgd_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const auto tuples = tuples_of(in, 4);
  const size_t count = in.size() < 8 ? 0 : tuples.size();  // 0: the single-tensor form
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("sgd_", j, count, tuples[j], {"param", "grad", "momentum_buffer", "master"});
  }
  const bool buffer = in[2].defined();
  const SgdConsts k{a.lr,       a.weight_decay,         a.momentum,
                    1.0 - a.dampening, a.weight_decay != 0.0, a.nesterov,
                    a.step_count == 1, a.grad_scale};
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const cudaStream_t stream = compute_stream(d);
  run_launch("sgd_", d, [&] {
    run_grouped(tuples, 3, {0, 2, 3},
                [&](int dtype, bool master, const OptimTuple* ts, int64_t count) {
                  launch_sgd(dtype, buffer, master, ts, count, k, stream);
                });
  });
}

TS_REGISTER_KERNEL(cuda, adamw_, adamw_kernel);
TS_REGISTER_KERNEL(cuda, adamw8bit_, adamw8bit_kernel);
// Inputs: the tensors to scale; a strided one is scaled in a contiguous copy, copied back.
void scale_kernel(std::span<const Tensor> in, std::span<Tensor>, const Attrs& a) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const cudaStream_t stream = compute_stream(d);
  for (size_t t = 0; t < in.size(); ++t) {
    const Tensor& x = in[t];  // (call_inplace refused expanded layouts)
    const bool direct = x.is_contiguous();
    const Tensor c = direct ? x : Tensor::empty(x.shape(), x.dtype(), d);
    if (!direct) copy_cuda(c, x);
    // As a flat run of elements (any number of dims).
    const DevTensor dc =
        dev_tensor(Tensor::from_storage(c.storage(), {c.numel()}, {1}, c.offset(), c.dtype()));
    run_launch("scale_", d, [&] { launch_scale(dc, a.scale, stream); });
    if (!direct) copy_cuda(x, c);
  }
}

TS_REGISTER_KERNEL(cuda, sgd_, sgd_kernel);
TS_REGISTER_KERNEL(cuda, scale_, scale_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels
