// Shape inference for the elementwise ops.
#include "tensor/internal/meta_util.h"

namespace tessera {
namespace {

using namespace internal;

template <OpId op>
std::vector<TensorSpec> unary_float(std::span<const TensorSpec> in, const Attrs&) {
  require_count(op, in, 1);
  require_float(op, in[0], "input");
  return {in[0]};
}

template <OpId op>
std::vector<TensorSpec> unary_numeric(std::span<const TensorSpec> in, const Attrs&) {
  require_count(op, in, 1);
  require_numeric(op, in[0], "input");
  return {in[0]};
}

std::vector<TensorSpec> gelu_backward_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::gelu_backward;
  require_count(op, in, 2);
  require_float(op, in[1], "input");
  require_same_dtype(op, in[0], in[1]);
  TS_CHECK(in[0].shape == in[1].shape, "gelu_backward: grad {} and input {} differ in shape",
           shape_str(in[0].shape), shape_str(in[1].shape));
  return {in[1]};
}

// 0-d CPU tensors (scalars) may join tensors on any device, as in PyTorch.
Device result_device(std::span<const TensorSpec> in) {
  for (const TensorSpec& t : in) {
    if (!t.device.is_cpu()) return t.device;
  }
  return in[0].device;
}

template <OpId op>
std::vector<TensorSpec> binary(std::span<const TensorSpec> in, const Attrs&) {
  require_count(op, in, 2);
  required(op, in, 1, "second operand");
  require_same_dtype(op, in[0], in[1]);
  require_numeric(op, in[0], "operands");
  return {spec(broadcast_shapes(name_of(op), in[0].shape, in[1].shape), in[0].dtype,
               result_device(in))};
}

template <OpId op>
std::vector<TensorSpec> binary_float(std::span<const TensorSpec> in, const Attrs& attrs) {
  std::vector<TensorSpec> out = binary<op>(in, attrs);
  TS_CHECK(is_floating(in[0].dtype),
           "{}: integer operands ({} {}); cast to a floating dtype first", name_of(op),
           in[0].dtype, shape_str(in[0].shape));
  return out;
}

template <OpId op>
std::vector<TensorSpec> compare(std::span<const TensorSpec> in, const Attrs&) {
  require_count(op, in, 2);
  required(op, in, 1, "second operand");
  require_same_dtype(op, in[0], in[1]);
  return {spec(broadcast_shapes(name_of(op), in[0].shape, in[1].shape), DType::b8,
               result_device(in))};
}

std::vector<TensorSpec> where_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::where;
  require_count(op, in, 3);
  required(op, in, 1, "a");
  required(op, in, 2, "b");
  TS_CHECK(in[0].dtype == DType::b8, "where: condition must be bool, got {} {}", in[0].dtype,
           shape_str(in[0].shape));
  require_same_dtype(op, in[1], in[2]);
  Shape s = broadcast_shapes("where", in[0].shape, in[1].shape);
  s = broadcast_shapes("where", s, in[2].shape);
  return {spec(s, in[1].dtype, result_device(in))};
}

// The functor families: one meta function per family.
#define TS_META_FAMILY(_, name, family, props) \
  register_meta(OpId::name, meta_##family<OpId::name>);
template <OpId op> constexpr MetaFn meta_UnaryFloat = &unary_float<op>;
template <OpId op> constexpr MetaFn meta_UnaryNumeric = &unary_numeric<op>;
template <OpId op> constexpr MetaFn meta_Binary = &binary<op>;
template <OpId op> constexpr MetaFn meta_BinaryFloat = &binary_float<op>;
template <OpId op> constexpr MetaFn meta_Compare = &compare<op>;
const bool kFamiliesRegistered = [] {
  TS_UNARY_OPS(TS_META_FAMILY, _)
  TS_BINARY_OPS(TS_META_FAMILY, _)
  TS_COMPARE_OPS(TS_META_FAMILY, _)
  return true;
}();
#undef TS_META_FAMILY

TS_REGISTER_META(gelu, unary_float<OpId::gelu>);
TS_REGISTER_META(gelu_backward, gelu_backward_meta);
TS_REGISTER_META(where, where_meta);

}  // namespace
}  // namespace tessera
