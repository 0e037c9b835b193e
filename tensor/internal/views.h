// Stride arithmetic shared by views.cc and reshape().
#pragma once

#include <optional>
#include <string_view>

#include "tensor/tensor.h"

namespace tessera::internal {

// Strides viewing old_shape/old_strides memory as `shape`, or nullopt if a copy is needed.
std::optional<Strides> view_strides(const Shape& old_shape, const Strides& old_strides,
                                    const Shape& shape);
// Resolves one -1 in `shape` against the element count of `from`; Error naming `op` if the
// counts cannot match.
Shape infer_view_shape(std::string_view op, const Shape& from, const Shape& shape);

}  // namespace tessera::internal
