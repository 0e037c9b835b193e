#include "tensor/dtype.h"

namespace tessera {

DType dtype_from_name(std::string_view name) {
  for (DType dt : kAllDTypes) {
    if (dtype_name(dt) == name) return dt;
  }
  if (name == "float32" || name == "float") return DType::f32;
  if (name == "float64" || name == "double") return DType::f64;
  if (name == "float16" || name == "half") return DType::f16;
  if (name == "bfloat16") return DType::bf16;
  if (name == "int32") return DType::i32;
  if (name == "int64") return DType::i64;
  if (name == "uint8") return DType::u8;
  fail("dtype: unknown name '{}' (expected f32, f64, f16, bf16, i32, i64, bool or u8)", name);
}

}  // namespace tessera
