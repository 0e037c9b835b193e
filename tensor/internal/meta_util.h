// Helpers shared by the shape-inference functions (tensor/meta_*.cc).
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "tensor/op.h"

namespace tessera::internal {

inline std::string_view name_of(OpId op) { return op_name(op); }

inline void require_count(OpId op, std::span<const TensorSpec> in, size_t n) {
  TS_CHECK(in.size() == n, "{}: expected {} inputs, got {}", name_of(op), n, in.size());
}

inline const TensorSpec& required(OpId op, std::span<const TensorSpec> in, size_t i,
                                  const char* what) {
  TS_CHECK(i < in.size() && in[i].defined, "{}: {} (input {}) is an undefined tensor",
           name_of(op), what, i);
  return in[i];
}

inline void require_float(OpId op, const TensorSpec& t, const char* what) {
  TS_CHECK(is_floating(t.dtype), "{}: {} must be floating (f32, f64, f16, bf16), got {} {}",
           name_of(op), what, t.dtype, shape_str(t.shape));
}

inline void require_numeric(OpId op, const TensorSpec& t, const char* what) {
  TS_CHECK(t.dtype != DType::b8, "{}: {} must be numeric, got bool {}", name_of(op), what,
           shape_str(t.shape));
  TS_CHECK(t.dtype != DType::u8, "{}: {} is u8 {} (codes, no arithmetic); cast it to i32 or f32 first",
           name_of(op), what, shape_str(t.shape));
}

inline void require_index(OpId op, const TensorSpec& t, const char* what) {
  TS_CHECK(is_integral(t.dtype), "{}: {} must be an integer tensor (i32 or i64), got {} {}",
           name_of(op), what, t.dtype, shape_str(t.shape));
}

inline void require_same_dtype(OpId op, const TensorSpec& a, const TensorSpec& b) {
  TS_CHECK(a.dtype == b.dtype,
           "{}: dtype mismatch ({} {} vs {} {}); cast one operand explicitly", name_of(op),
           a.dtype, shape_str(a.shape), b.dtype, shape_str(b.shape));
}

inline void require_ndim(OpId op, const TensorSpec& t, int64_t ndim, const char* what) {
  TS_CHECK(static_cast<int64_t>(t.shape.size()) == ndim, "{}: {} must be {}-D, got shape {}",
           name_of(op), what, ndim, shape_str(t.shape));
}

// The inputs of a multi-tensor op (sum_squares, scale_): at least one, each defined and
// floating, all on input 0's device.
inline void require_floats_on_one_device(OpId op, std::span<const TensorSpec> in) {
  TS_CHECK(!in.empty(), "{}: expected at least one tensor, got none", name_of(op));
  for (size_t i = 0; i < in.size(); ++i) {
    TS_CHECK(in[i].defined, "{}: tensor {} of {} is an undefined tensor", name_of(op), i, in.size());
    TS_CHECK(is_floating(in[i].dtype),
             "{}: tensor {} of {} must be floating (f32, f64, f16, bf16), got {} {}", name_of(op),
             i, in.size(), in[i].dtype, shape_str(in[i].shape));
    TS_CHECK(in[i].device == in[0].device, "{}: tensor {} of {} is on {}, tensor 0 on {}",
             name_of(op), i, in.size(), in[i].device, in[0].device);
  }
}

inline TensorSpec spec(Shape shape, DType dtype, Device device) {
  return TensorSpec{std::move(shape), dtype, device, true};
}

inline TensorSpec absent() { return TensorSpec{{}, DType::f32, kCPU, false}; }

// Shape of a reduction's output.
inline Shape reduced_shape(const Shape& in, const std::vector<int64_t>& dims, bool keepdim) {
  Shape out;
  size_t k = 0;
  for (int64_t d = 0; d < static_cast<int64_t>(in.size()); ++d) {
    const bool reduced = k < dims.size() && dims[k] == d;
    if (reduced) {
      ++k;
      if (keepdim) out.push_back(1);
    } else {
      out.push_back(in[d]);
    }
  }
  return out;
}

// The dtype statistics like layer_norm's mean/rstd and cross_entropy's logsumexp keep.
inline DType stats_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace tessera::internal
