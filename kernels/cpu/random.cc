// CPU random kernels: rand, randn and dropout, all keyed by (seed, offset + global index)
// through Philox, so they match any other device and any block of the logical tensor.
#include <cmath>
#include <limits>

#include "kernels/cpu/loops.h"
#include "kernels/cpu/util.h"
#include "tensor/op.h"
#include "tensor/random.h"

namespace tessera::cpu {
namespace {

// Maps local linear indices to counters: offset + index in the logical (global) tensor.
class CounterMap {
 public:
  CounterMap(const Shape& local, const Attrs& a) : offset_(a.offset) {
    const RngView& v = a.rng_view;
    if (v.global_shape.empty() || v.global_shape == local) return;
    local_ = local;
    global_strides_ = contiguous_strides(v.global_shape);
    base_ = 0;
    for (size_t d = 0; d < local.size(); ++d) base_ += v.starts[d] * global_strides_[d];
  }
  uint64_t operator()(int64_t i) const {
    if (local_.empty()) return offset_ + static_cast<uint64_t>(i);
    int64_t g = base_;
    for (int64_t d = static_cast<int64_t>(local_.size()) - 1; d >= 0; --d) {
      g += (i % local_[d]) * global_strides_[d];
      i /= local_[d];
    }
    return offset_ + static_cast<uint64_t>(g);
  }

 private:
  uint64_t offset_;
  Shape local_;
  Strides global_strides_;
  int64_t base_ = 0;
};

// Largest value below 1 in T, so rounding a uniform draw never yields 1.
template <typename T>
T below_one() {
  if constexpr (std::is_same_v<T, Half>) return Half::from_bits(0x3bff);
  else if constexpr (std::is_same_v<T, BFloat16>) return BFloat16::from_bits(0x3f7f);
  else return std::nextafter(T(1), T(0));
}

void rand_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  const CounterMap counter(out[0].shape(), a);
  visit_float_dtype(out[0].dtype(), "rand", [&]<typename T>() {
    T* p = static_cast<T*>(out[0].raw_data());
    parallel_for(0, out[0].numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if constexpr (std::is_same_v<T, double>) {
          p[i] = philox::uniform_f64(a.seed, counter(i));
        } else {
          T v = T(philox::uniform(a.seed, counter(i)));
          if (static_cast<float>(v) >= 1.0f) v = below_one<T>();
          p[i] = v;
        }
      }
    });
  });
}

void randn_kernel(std::span<const Tensor>, std::span<Tensor> out, const Attrs& a) {
  const CounterMap counter(out[0].shape(), a);
  visit_float_dtype(out[0].dtype(), "randn", [&]<typename T>() {
    T* p = static_cast<T*>(out[0].raw_data());
    parallel_for(0, out[0].numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) p[i] = T(philox::normal(a.seed, counter(i)));
    });
  });
}

// Keeps element i when its uniform draw is >= p, scaling kept values by 1 / (1 - p).
void dropout_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& a) {
  const Tensor x = contiguous_cpu(in[0]);
  const CounterMap counter(x.shape(), a);
  const float p = static_cast<float>(a.p);
  visit_float_dtype(x.dtype(), "dropout", [&]<typename T>() {
    using C = compute_t<T>;
    const T* xp = static_cast<const T*>(x.raw_data());
    T* yp = static_cast<T*>(out[0].raw_data());
    const C scale = C(1.0 / (1.0 - a.p));
    parallel_for(0, x.numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const bool keep = philox::uniform(a.seed, counter(i)) >= p;
        yp[i] = keep ? T(C(xp[i]) * scale) : T(C(0));
      }
    });
  });
}

TS_REGISTER_KERNEL(cpu, rand, rand_kernel);
TS_REGISTER_KERNEL(cpu, randn, randn_kernel);
TS_REGISTER_KERNEL(cpu, dropout, dropout_kernel);

}  // namespace
}  // namespace tessera::cpu
