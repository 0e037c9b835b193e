// Shape inference for the reductions (sum, mean, max, argmax, var, sum_squares).
#include "tensor/internal/meta_util.h"

namespace tessera {
namespace {

using namespace internal;

template <OpId op>
std::vector<TensorSpec> reduce(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(op, in, 1);
  const TensorSpec& x = in[0];
  const auto dims = normalize_dims(name_of(op), attrs.dims, static_cast<int64_t>(x.shape.size()));
  DType out = x.dtype;
  if constexpr (op == OpId::sum) {
    if (x.dtype == DType::b8) out = DType::i64;
  } else if constexpr (op == OpId::mean || op == OpId::var) {
    require_float(op, x, "input");
  } else {
    require_numeric(op, x, "input");
  }
  if constexpr (op == OpId::max) {
    for (int64_t d : dims) {
      TS_CHECK(x.shape[d] > 0, "max: cannot reduce over dim {} of size 0 (shape {})", d,
               shape_str(x.shape));
    }
  }
  return {spec(reduced_shape(x.shape, dims, attrs.keepdim), out, x.device)};
}

std::vector<TensorSpec> argmax_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::argmax;
  require_count(op, in, 1);
  const TensorSpec& x = in[0];
  require_numeric(op, x, "input");
  TS_CHECK(numel_of(x.shape) > 0, "argmax: empty input {}", shape_str(x.shape));
  const int64_t ndim = static_cast<int64_t>(x.shape.size());
  if (attrs.all_dims) {
    Shape s = attrs.keepdim ? Shape(ndim, 1) : Shape{};
    return {spec(s, DType::i64, x.device)};
  }
  const int64_t d = normalize_dim("argmax", attrs.dim, ndim);
  return {spec(reduced_shape(x.shape, ndim == 0 ? std::vector<int64_t>{} : std::vector<int64_t>{d},
                             attrs.keepdim),
               DType::i64, x.device)};
}

// sum_squares(x1, ..., xk): floating tensors of any shapes on one device -> f64 [].
std::vector<TensorSpec> sum_squares_meta(std::span<const TensorSpec> in, const Attrs&) {
  require_floats_on_one_device(OpId::sum_squares, in);
  return {spec({}, DType::f64, in[0].device)};
}

TS_REGISTER_META(sum, reduce<OpId::sum>);
TS_REGISTER_META(sum_squares, sum_squares_meta);
TS_REGISTER_META(mean, reduce<OpId::mean>);
TS_REGISTER_META(max, reduce<OpId::max>);
TS_REGISTER_META(var, reduce<OpId::var>);
TS_REGISTER_META(argmax, argmax_meta);

}  // namespace
}  // namespace tessera
