// What the CPU and CUDA profiles (TESSERA_PROFILE, kernels/cpu/profile.cc and
// kernels/cuda/profile.cc) share for their tables by operand shape (TESSERA_PROFILE_SHAPES=1).
#pragma once

#include <span>
#include <string>

#include "tensor/op.h"

namespace tessera::cpu {

// Whether TESSERA_PROFILE_SHAPES asks for the tables by operand shape.
bool profile_shapes_requested();
// The GEMM ops: matmul, linear, grouped matmul, conv (and their backward ops).
bool is_gemm_op(OpId op);
// "[16,128,512]N": an operand's dims, and the layout of its last two (N row-major,
// T transposed, S other strides).
std::string operand_key(const Tensor& t);
// The FLOPs of a matmul (2 m n k per product over the broadcast batch) or a linear (2 rows
// N K); 0 for the other ops.
double gemm_flops(OpId op, std::span<const Tensor> in);

}  // namespace tessera::cpu
