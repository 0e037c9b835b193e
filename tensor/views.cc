// View ops: new shape/strides/offset over the same storage. No data moves here.
#include <algorithm>
#include <optional>

#include "tensor/internal/meta_util.h"
#include "tensor/internal/views.h"

namespace tessera {
namespace internal {

// The strides that let `shape` view memory laid out as old_shape/old_strides, if any
// (the rule PyTorch's view uses: each contiguous chunk of the old shape must map onto a
// run of new dims).
std::optional<Strides> view_strides(const Shape& old_shape, const Strides& old_strides,
                                    const Shape& shape) {
  if (old_shape.empty() || numel_of(old_shape) == 0) return contiguous_strides(shape);
  Strides strides(shape.size(), 1);
  int64_t view_d = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(old_shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    if (d == 0 || (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

Shape infer_view_shape(std::string_view op, const Shape& from, const Shape& shape) {
  Shape out = shape;
  int64_t infer = -1, known = 1;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      TS_CHECK(infer < 0, "{}: shape {} has more than one -1", op, shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else {
      TS_CHECK(out[i] >= 0, "{}: invalid size {} in shape {}", op, out[i], shape_str(shape));
      TS_CHECK(!__builtin_mul_overflow(known, out[i], &known),
               "{}: shape {} has more elements than an int64 counts", op, shape_str(shape));
    }
  }
  const int64_t n = numel_of(from);
  if (infer >= 0) {
    TS_CHECK(known != 0 && n % known == 0, "{}: cannot infer -1 in shape {} for {} elements "
             "(input {})", op, shape_str(shape), n, shape_str(from));
    out[infer] = n / known;
  }
  TS_CHECK(numel_of(out) == n, "{}: shape {} has {} elements but input {} has {}", op,
           shape_str(shape), numel_of(out), shape_str(from), n);
  return out;
}

Tensor make_view(const Tensor& x, Shape shape, Strides strides, int64_t offset) {
  return Tensor::from_storage(x.storage(), shape, strides, offset, x.dtype());
}

}  // namespace internal

namespace {

using namespace internal;

Tensor view_fn(const Tensor& x, const Attrs& a) {
  const Shape shape = infer_view_shape("view", x.shape(), a.shape);
  auto strides = view_strides(x.shape(), x.strides(), shape);
  if (!strides) {
    fail("view: cannot view shape {} with strides {} as {} without copying; use reshape()",
         shape_str(x.shape()), shape_str(x.strides()), shape_str(shape));
  }
  return make_view(x, shape, *strides, x.offset());
}

Tensor permute_fn(const Tensor& x, const Attrs& a) {
  const int64_t n = x.dim();
  TS_CHECK(static_cast<int64_t>(a.dims.size()) == n,
           "permute: order [{}] has {} entries for a {}-d tensor {}", fmt::join(a.dims, ", "),
           a.dims.size(), n, shape_str(x.shape()));
  std::vector<bool> seen(n, false);
  Shape shape(n);
  Strides strides(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = normalize_dim("permute", a.dims[i], n);
    TS_CHECK(!seen[d], "permute: order [{}] repeats dim {}", fmt::join(a.dims, ", "), d);
    seen[d] = true;
    shape[i] = x.shape()[d];
    strides[i] = x.strides()[d];
  }
  return make_view(x, shape, strides, x.offset());
}

Tensor slice_fn(const Tensor& x, const Attrs& a) {
  TS_CHECK(x.dim() > 0, "slice: cannot slice a 0-d tensor");
  const int64_t d = normalize_dim("slice", a.dim, x.dim());
  TS_CHECK(a.step > 0, "slice: step must be positive, got {}", a.step);
  const int64_t size = x.shape()[d];
  auto clamp = [size](int64_t i) {
    if (i < 0) i += size;
    return std::clamp<int64_t>(i, 0, size);
  };
  const int64_t start = clamp(a.start), end = std::max(clamp(a.end), clamp(a.start));
  Shape shape = x.shape();
  Strides strides = x.strides();
  shape[d] = (end - start + a.step - 1) / a.step;
  strides[d] *= a.step;
  return make_view(x, shape, strides, x.offset() + start * x.strides()[d]);
}

Tensor expand_fn(const Tensor& x, const Attrs& a) {
  const int64_t n = static_cast<int64_t>(a.shape.size());
  TS_CHECK(n >= x.dim(), "expand: target {} has fewer dims than input {}", shape_str(a.shape),
           shape_str(x.shape()));
  Shape shape(n);
  Strides strides(n, 0);
  const int64_t lead = n - x.dim();
  for (int64_t i = 0; i < n; ++i) {
    if (i < lead) {
      TS_CHECK(a.shape[i] >= 0, "expand: new leading dim {} of {} cannot be -1", i,
               shape_str(a.shape));
      shape[i] = a.shape[i];
      continue;
    }
    const int64_t have = x.shape()[i - lead];
    const int64_t want = a.shape[i] == -1 ? have : a.shape[i];
    if (have == want) {
      shape[i] = have;
      strides[i] = x.strides()[i - lead];
    } else {
      TS_CHECK(have == 1, "expand: cannot expand {} to {} (dim {}: {} is not 1)",
               shape_str(x.shape()), shape_str(a.shape), i, have);
      shape[i] = want;
    }
  }
  return make_view(x, shape, strides, x.offset());
}

Tensor squeeze_fn(const Tensor& x, const Attrs& a) {
  std::vector<bool> drop(x.dim(), false);
  if (a.dims.empty()) {
    for (int64_t i = 0; i < x.dim(); ++i) drop[i] = x.shape()[i] == 1;
  } else {
    for (int64_t d : a.dims) {
      const int64_t k = normalize_dim("squeeze", d, x.dim());
      if (x.dim() > 0) drop[k] = x.shape()[k] == 1;
    }
  }
  Shape shape;
  Strides strides;
  for (int64_t i = 0; i < x.dim(); ++i) {
    if (drop[i]) continue;
    shape.push_back(x.shape()[i]);
    strides.push_back(x.strides()[i]);
  }
  return make_view(x, shape, strides, x.offset());
}

Tensor unsqueeze_fn(const Tensor& x, const Attrs& a) {
  const int64_t d = normalize_dim("unsqueeze", a.dim, x.dim() + 1);
  Shape shape = x.shape();
  Strides strides = x.strides();
  const int64_t stride = d < x.dim() ? shape[d] * strides[d] : 1;
  shape.insert(shape.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  return make_view(x, shape, strides, x.offset());
}

TS_REGISTER_VIEW(view, view_fn);
TS_REGISTER_VIEW(permute, permute_fn);
TS_REGISTER_VIEW(slice, slice_fn);
TS_REGISTER_VIEW(expand, expand_fn);
TS_REGISTER_VIEW(squeeze, squeeze_fn);
TS_REGISTER_VIEW(unsqueeze, unsqueeze_fn);

}  // namespace
}  // namespace tessera
