#include "parallel/comm/threads_reduce.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "tensor/error.h"

namespace tessera::parallel::internal {
namespace {


// a op b in the accumulation type A. Integers wrap like the hardware (no signed-overflow
// UB); max/min propagate NaN; bool (uint8_t 0/1): sum and max are or, min is and.
template <ReduceOp kOp, typename A>
A combine(A a, A b) {
  if constexpr (std::is_same_v<A, uint8_t>) {
    return static_cast<A>(kOp == ReduceOp::min ? (a & b) : (a | b));
  } else if constexpr (kOp == ReduceOp::max || kOp == ReduceOp::min) {
    const bool take_b = kOp == ReduceOp::max ? b > a : b < a;
    if constexpr (std::is_floating_point_v<A>) return (take_b || std::isnan(b)) ? b : a;
    else return take_b ? b : a;
  } else if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

// out[i] = store(src[0][i] combine src[1][i] combine ...), left to right. Works through an
// L1-sized accumulator so each loop is a plain vectorisable pass, and so `out` may alias one
// of the sources (all sources of a chunk are read before it is written).
template <typename T, typename Acc, typename Load, typename Combine, typename Store>
void reduce_loop(T* out, const std::vector<const T*>& src, int64_t count, Load load,
                 Combine combine, Store store) {
  constexpr int64_t kChunk = 1024;
  Acc acc[kChunk];
  const size_t n = src.size();
  for (int64_t i0 = 0; i0 < count; i0 += kChunk) {
    const int64_t len = std::min(kChunk, count - i0);
    const T* s0 = src[0] + i0;
    for (int64_t j = 0; j < len; ++j) acc[j] = load(s0[j]);
    for (size_t m = 1; m < n; ++m) {
      const T* sm = src[m] + i0;
      for (int64_t j = 0; j < len; ++j) acc[j] = combine(acc[j], load(sm[j]));
    }
    T* o = out + i0;
    for (int64_t j = 0; j < len; ++j) o[j] = store(acc[j]);
  }
}

// T is the storage type, Acc the accumulation type: f16/bf16 accumulate in f32 and round
// once in store; avg divides the sum by the member count (floating dtypes only).
template <typename T, typename Acc>
void reduce_typed(ReduceOp op, char* out, const std::vector<const char*>& src, int64_t count) {
  std::vector<const T*> s(src.size());
  for (size_t m = 0; m < src.size(); ++m) s[m] = reinterpret_cast<const T*>(src[m]);
  T* o = reinterpret_cast<T*>(out);
  auto load = [](T x) {
    if constexpr (std::is_same_v<T, uint8_t>) return static_cast<Acc>(x != 0);
    else return static_cast<Acc>(x);
  };
  auto store = [](Acc a) { return T(a); };
  auto loop = [&]<ReduceOp kOp>(auto finish) {
    auto op = [](Acc a, Acc b) { return combine<kOp, Acc>(a, b); };
    reduce_loop<T, Acc>(o, s, count, load, op, finish);
  };
  const Acc n = static_cast<Acc>(src.size());
  switch (op) {
    case ReduceOp::sum: return loop.template operator()<ReduceOp::sum>(store);
    case ReduceOp::max: return loop.template operator()<ReduceOp::max>(store);
    case ReduceOp::min: return loop.template operator()<ReduceOp::min>(store);
    case ReduceOp::avg:
      if constexpr (std::is_floating_point_v<Acc>) {
        return loop.template operator()<ReduceOp::sum>([n](Acc a) { return T(a / n); });
      }
      break;
  }
  fail("threads backend: avg needs a floating dtype");  // the public method checked this
}

}  // namespace

void reduce_into(DType dt, ReduceOp op, char* out, const std::vector<const char*>& src,
                 int64_t count) {
  switch (dt) {
    case DType::f32: return reduce_typed<float, float>(op, out, src, count);
    case DType::f64: return reduce_typed<double, double>(op, out, src, count);
    case DType::f16: return reduce_typed<Half, float>(op, out, src, count);
    case DType::bf16: return reduce_typed<BFloat16, float>(op, out, src, count);
    case DType::i32: return reduce_typed<int32_t, int32_t>(op, out, src, count);
    case DType::i64: return reduce_typed<int64_t, int64_t>(op, out, src, count);
    case DType::b8: return reduce_typed<uint8_t, uint8_t>(op, out, src, count);
    case DType::u8: fail("threads backend: u8 tensors hold codes and are not reduced");
  }
}

}  // namespace tessera::parallel::internal
