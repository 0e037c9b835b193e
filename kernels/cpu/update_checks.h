// Operand checks shared by the CPU and CUDA kernels of the fused optimizer updates
// (adamw_, sgd_): the multi-tensor form's tuples, and no overlap between a tuple's operands.
//
//   for (size_t j = 0; auto t : tuples_of(in, 5)) check_no_overlap("adamw_", j++, n, t, names);
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::cpu {

// The element span [lo, hi) in bytes of storage that t touches.
std::pair<int64_t, int64_t> byte_extent(const Tensor& t);

// The update loops read and write each element of every operand once, so operands must not
// overlap (views of one flat buffer are fine when they are disjoint). `tuple` of `tuples`
// names the tuple of a multi-tensor call in the error (tuples == 0: the single-tensor form).
void check_no_overlap(std::string_view op, size_t tuple, size_t tuples,
                      std::span<const Tensor> in, std::initializer_list<const char*> names);

// adamw8bit_'s tuples (tuples_of(in, 7); `tuples` 0 for the single-tensor form): no overlap,
// and every operand but grad contiguous (blocks are runs of consecutive elements). Checks
// every tuple before any is written.
void check_adamw8bit_operands(std::span<const std::span<const Tensor>> tuples, size_t count);

// adamw8bit_segments_'s inputs (tensor/ops.h): no overlap, every operand but grad contiguous,
// and the segments (read here, on the CPU) cutting the param into runs of 1 to kQuant8Block
// elements in order, each of one block, the blocks increasing and in range.
void check_adamw8bit_segments_operands(std::span<const Tensor> in);

// The tuples of `width` inputs of a multi-tensor call; the short single-tensor form is one
// tuple.
std::vector<std::span<const Tensor>> tuples_of(std::span<const Tensor> in, size_t width);

}  // namespace tessera::cpu
