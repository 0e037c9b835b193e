// Shape inference for the data ops: indexing, joining, copies and conversions, factories.
#include <cmath>

#include "tensor/internal/meta_util.h"

namespace tessera {
namespace {

using namespace internal;

std::vector<TensorSpec> embedding_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::embedding;
  require_count(op, in, 2);
  const TensorSpec& w = in[0];
  const TensorSpec& idx = required(op, in, 1, "indices");
  require_ndim(op, w, 2, "weight ([V, D])");
  require_index(op, idx, "indices");
  Shape out = idx.shape;
  out.push_back(w.shape[1]);
  return {spec(out, w.dtype, w.device)};
}

std::vector<TensorSpec> index_select_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::index_select;
  require_count(op, in, 2);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  require_index(op, idx, "index");
  require_ndim(op, idx, 1, "index");
  const int64_t d = normalize_dim("index_select", attrs.dim, static_cast<int64_t>(x.shape.size()));
  TS_CHECK(!x.shape.empty(), "index_select: input must have at least one dim");
  Shape out = x.shape;
  out[d] = idx.shape[0];
  return {spec(out, x.dtype, x.device)};
}

std::vector<TensorSpec> index_add_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::index_add;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  const TensorSpec& src = required(op, in, 2, "source");
  require_index(op, idx, "index");
  require_ndim(op, idx, 1, "index");
  require_same_dtype(op, x, src);
  require_numeric(op, x, "input");
  TS_CHECK(!x.shape.empty(), "index_add: input must have at least one dim");
  const int64_t d = normalize_dim("index_add", attrs.dim, static_cast<int64_t>(x.shape.size()));
  Shape expected = x.shape;
  expected[d] = idx.shape[0];
  TS_CHECK(src.shape == expected,
           "index_add: source shape {} must be {} (input {} with dim {} of index length {})",
           shape_str(src.shape), shape_str(expected), shape_str(x.shape), d, idx.shape[0]);
  return {x};
}

std::vector<TensorSpec> gather_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::gather;
  require_count(op, in, 2);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  require_index(op, idx, "index");
  TS_CHECK(idx.shape.size() == x.shape.size() && !x.shape.empty(),
           "gather: index {} must have the same rank as input {}", shape_str(idx.shape),
           shape_str(x.shape));
  const int64_t d = normalize_dim("gather", attrs.dim, static_cast<int64_t>(x.shape.size()));
  for (size_t i = 0; i < x.shape.size(); ++i) {
    TS_CHECK(static_cast<int64_t>(i) == d || idx.shape[i] <= x.shape[i],
             "gather: index {} exceeds input {} in dim {}", shape_str(idx.shape),
             shape_str(x.shape), i);
  }
  return {spec(idx.shape, x.dtype, x.device)};
}

// topk: values (x's dtype) and i64 indices, x's shape with k along dim.
std::vector<TensorSpec> topk_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::topk;
  require_count(op, in, 1);
  const TensorSpec& x = in[0];
  require_numeric(op, x, "input");
  TS_CHECK(!x.shape.empty(), "topk: input must have at least one dim, got a 0-d tensor");
  const int64_t d = normalize_dim("topk", attrs.dim, static_cast<int64_t>(x.shape.size()));
  TS_CHECK(attrs.k >= 0 && attrs.k <= x.shape[d],
           "topk: k = {} is outside [0, {}] (dim {} of input {})", attrs.k, x.shape[d], d,
           shape_str(x.shape));
  Shape s = x.shape;
  s[d] = attrs.k;
  return {spec(s, x.dtype, x.device), spec(s, DType::i64, x.device)};
}

// counting_sort: keys [n] (integers in [0, k); checked by the kernel) -> the stable order
// that sorts them, i64 [n], and the count of each key, i64 [k].
std::vector<TensorSpec> counting_sort_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::counting_sort;
  require_count(op, in, 1);
  const TensorSpec& keys = required(op, in, 0, "keys");
  require_index(op, keys, "keys");
  require_ndim(op, keys, 1, "keys");
  TS_CHECK(attrs.k >= 1, "counting_sort: the number of buckets k = {} must be >= 1 (keys {})",
           attrs.k, shape_str(keys.shape));
  return {spec(keys.shape, DType::i64, keys.device), spec({attrs.k}, DType::i64, keys.device)};
}

std::vector<TensorSpec> scatter_add_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::scatter_add;
  require_count(op, in, 3);
  const TensorSpec& x = in[0];
  const TensorSpec& idx = required(op, in, 1, "index");
  const TensorSpec& src = required(op, in, 2, "src");
  require_index(op, idx, "index");
  require_same_dtype(op, x, src);
  require_numeric(op, x, "input");
  TS_CHECK(idx.shape.size() == x.shape.size() && src.shape.size() == x.shape.size() &&
               !x.shape.empty(),
           "scatter_add: input {}, index {} and src {} must have the same rank",
           shape_str(x.shape), shape_str(idx.shape), shape_str(src.shape));
  const int64_t d = normalize_dim("scatter_add", attrs.dim, static_cast<int64_t>(x.shape.size()));
  for (size_t i = 0; i < x.shape.size(); ++i) {
    TS_CHECK(idx.shape[i] <= src.shape[i] &&
                 (static_cast<int64_t>(i) == d || idx.shape[i] <= x.shape[i]),
             "scatter_add: index {} exceeds src {} or input {} in dim {}", shape_str(idx.shape),
             shape_str(src.shape), shape_str(x.shape), i);
  }
  return {x};
}

std::vector<TensorSpec> cat_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  constexpr OpId op = OpId::cat;
  TS_CHECK(!in.empty(), "cat: needs at least one tensor");
  const TensorSpec& first = in[0];
  TS_CHECK(!first.shape.empty(), "cat: zero-dimensional tensors cannot be concatenated");
  const int64_t d = normalize_dim("cat", attrs.dim, static_cast<int64_t>(first.shape.size()));
  Shape out = first.shape;
  out[d] = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const TensorSpec& t = required(op, in, i, "tensor");
    require_same_dtype(op, first, t);
    bool ok = t.shape.size() == first.shape.size();
    for (size_t k = 0; ok && k < t.shape.size(); ++k) {
      ok = static_cast<int64_t>(k) == d || t.shape[k] == first.shape[k];
    }
    TS_CHECK(ok, "cat: tensor {} has shape {}, incompatible with {} along dim {}", i,
             shape_str(t.shape), shape_str(first.shape), d);
    out[d] += t.shape[d];
  }
  return {spec(out, first.dtype, first.device)};
}

std::vector<TensorSpec> cast_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(OpId::cast, in, 1);
  return {spec(in[0].shape, attrs.dtype, in[0].device)};
}

// sign_pack: x (floating, any shape) -> u8 [ceil(numel / 8)].
std::vector<TensorSpec> sign_pack_meta(std::span<const TensorSpec> in, const Attrs&) {
  require_count(OpId::sign_pack, in, 1);
  TS_CHECK(is_floating(in[0].dtype), "sign_pack: x must be floating (f32, f64, f16, bf16), got {} {}",
           in[0].dtype, shape_str(in[0].shape));
  return {spec({(numel_of(in[0].shape) + 7) / 8}, DType::u8, in[0].device)};
}

// sign_unpack: bits (u8 [m]) -> attrs.dtype [n] with attrs.shape = {n}, m = ceil(n / 8).
std::vector<TensorSpec> sign_unpack_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(OpId::sign_unpack, in, 1);
  const TensorSpec& bits = in[0];
  TS_CHECK(bits.dtype == DType::u8 && bits.shape.size() == 1,
           "sign_unpack: bits must be u8 [m] (8 signs a byte), got {} {}", bits.dtype,
           shape_str(bits.shape));
  TS_CHECK(attrs.shape.size() == 1 && attrs.shape[0] >= 0 && (attrs.shape[0] + 7) / 8 == bits.shape[0],
           "sign_unpack: numel {} does not fit {} bytes of signs (it needs {} < numel <= {})",
           attrs.shape.empty() ? -1 : attrs.shape[0], bits.shape[0],
           std::max<int64_t>(0, 8 * (bits.shape[0] - 1)), 8 * bits.shape[0]);
  TS_CHECK(is_floating(attrs.dtype), "sign_unpack: dtype must be floating, got {}", attrs.dtype);
  return {spec(attrs.shape, attrs.dtype, bits.device)};
}

std::vector<TensorSpec> to_device_meta(std::span<const TensorSpec> in, const Attrs& attrs) {
  require_count(OpId::to_device, in, 1);
  return {spec(in[0].shape, in[0].dtype, attrs.device)};
}

std::vector<TensorSpec> clone_meta(std::span<const TensorSpec> in, const Attrs&) {
  require_count(OpId::clone, in, 1);
  return {in[0]};
}

// Inputs: dst, src. src broadcasts to dst's shape and is cast to dst's dtype.
std::vector<TensorSpec> copy_meta(std::span<const TensorSpec> in, const Attrs&) {
  constexpr OpId op = OpId::copy_;
  require_count(op, in, 2);
  const TensorSpec& src = required(op, in, 1, "src");
  const Shape s = broadcast_shapes("copy_", in[0].shape, src.shape);
  TS_CHECK(s == in[0].shape, "copy_: src shape {} does not broadcast to dst shape {}",
           shape_str(src.shape), shape_str(in[0].shape));
  return {in[0]};
}

void check_factory_shape(OpId op, const Shape& shape) {
  for (int64_t s : shape) {
    TS_CHECK(s >= 0, "{}: negative size in shape {}", name_of(op), shape_str(shape));
  }
}

// Integer tensors take only values they hold exactly (as scalar operands do); bool takes
// any value (nonzero is true).
void check_integral_value(OpId op, DType dt, double v, const char* what) {
  if (!is_integral(dt)) return;
  TS_CHECK(std::isfinite(v) && std::trunc(v) == v, "{}: {} {} is not representable in dtype {}",
           name_of(op), what, v, dt);
}

std::vector<TensorSpec> full_meta(std::span<const TensorSpec>, const Attrs& attrs) {
  check_factory_shape(OpId::full, attrs.shape);
  check_integral_value(OpId::full, attrs.dtype, attrs.value, "value");
  return {spec(attrs.shape, attrs.dtype, attrs.device)};
}

std::vector<TensorSpec> arange_meta(std::span<const TensorSpec>, const Attrs& a) {
  TS_CHECK(a.range_step != 0.0, "arange: step must be non-zero");
  TS_CHECK(std::isfinite(a.range_start) && std::isfinite(a.range_end),
           "arange: start {} and end {} must be finite", a.range_start, a.range_end);
  TS_CHECK(a.dtype != DType::b8, "arange: bool dtype is not supported");
  check_integral_value(OpId::arange, a.dtype, a.range_start, "start");
  check_integral_value(OpId::arange, a.dtype, a.range_step, "step");
  const double n = std::ceil((a.range_end - a.range_start) / a.range_step);
  return {spec({n > 0 ? static_cast<int64_t>(n) : 0}, a.dtype, a.device)};
}

template <OpId op>
std::vector<TensorSpec> random_meta(std::span<const TensorSpec>, const Attrs& attrs) {
  check_factory_shape(op, attrs.shape);
  TS_CHECK(is_floating(attrs.dtype), "{}: dtype must be floating, got {}", name_of(op),
           attrs.dtype);
  const RngView& v = attrs.rng_view;
  if (!v.global_shape.empty()) {
    TS_CHECK(v.global_shape.size() == attrs.shape.size() && v.starts.size() == attrs.shape.size(),
             "{}: block shape {} and global shape {} / starts [{}] differ in rank", name_of(op),
             shape_str(attrs.shape), shape_str(v.global_shape), fmt::join(v.starts, ", "));
    for (size_t i = 0; i < attrs.shape.size(); ++i) {
      TS_CHECK(v.starts[i] >= 0 && v.starts[i] + attrs.shape[i] <= v.global_shape[i],
               "{}: block {} at [{}] exceeds global shape {}", name_of(op),
               shape_str(attrs.shape), fmt::join(v.starts, ", "), shape_str(v.global_shape));
    }
  }
  return {spec(attrs.shape, attrs.dtype, attrs.device)};
}

TS_REGISTER_META(embedding, embedding_meta);
TS_REGISTER_META(index_select, index_select_meta);
TS_REGISTER_META(index_add, index_add_meta);
TS_REGISTER_META(gather, gather_meta);
TS_REGISTER_META(scatter_add, scatter_add_meta);
TS_REGISTER_META(topk, topk_meta);
TS_REGISTER_META(counting_sort, counting_sort_meta);
TS_REGISTER_META(cat, cat_meta);
TS_REGISTER_META(cast, cast_meta);
TS_REGISTER_META(sign_pack, sign_pack_meta);
TS_REGISTER_META(sign_unpack, sign_unpack_meta);
TS_REGISTER_META(to_device, to_device_meta);
TS_REGISTER_META(clone, clone_meta);
TS_REGISTER_META(copy_, copy_meta);
TS_REGISTER_META(full, full_meta);
TS_REGISTER_META(arange, arange_meta);
TS_REGISTER_META(rand, random_meta<OpId::rand>);
TS_REGISTER_META(randn, random_meta<OpId::randn>);

}  // namespace
}  // namespace tessera
