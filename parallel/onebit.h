// 1-bit compressed all-reduce with error feedback on both sides (Tang et al., "1-bit Adam:
// Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021;
// DeepSpeed's compressed_allreduce), the reduction 1-bit Adam sends its momentum through:
//
//   x.copy_(...);  onebit_all_reduce(comm, x, worker_error, server_error);   // x: ~ the mean
//
// With W ranks and x of n elements (a multiple of 8 W: onebit_padded), on every rank:
//   worker:  y = x + worker_error; s = scale(y); worker_error = y - s sign(y)
//            (sign(0) = +1); y's signs packed 8 a byte (sign_pack)
//   phase 1: all-to-all of the packed signs (rank j receives every rank's chunk j of n / W
//            elements) and all-gather of the scales s
//   server j: z = sum_i sign_i * (s_i / W) over the ranks i, in rank order, + server_error;
//            t = scale(z); server_error = z - t sign(z)
//   phase 2: all-gather of the servers' packed signs and scales t
//   x = chunk by chunk, t_j sign(z_j)
// So each rank sends about n / 4 bytes (two passes of n bits) instead of an all-reduce's
// 2 x 4 n (W - 1) / W; the errors carry what the signs lost into the next call.
// worker_error is [n] and server_error [n / W], in x's dtype, zero at first; all contiguous.
//
// scale(v) over v's m elements: l1 = sum |v| / m (the default), or l2 = ||v|| / sqrt(m)
// (DeepSpeed's and the paper's, which keeps the norm). l1 is the scale with the least error:
// ||v - s sign(v)||^2 = ||v||^2 - (sum |v|)^2 / m, never above ||v||^2 (the contraction the
// error-feedback proofs assume: Karimireddy et al., "Error Feedback Fixes SignSGD", 2019).
// Under l2 it is ||v||^2 (2 - 2 sum |v| / (sqrt(m) ||v||)), above ||v||^2 wherever a few
// elements dominate (sum |v| < sqrt(m) ||v|| / 2), and every element moves by the RMS, at
// least the mean |v|. On the default GPT, 1-bit Adam diverges with l2 and not with l1
// (BENCHMARKS.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/comm/communicator.h"
#include "tensor/tensor.h"

namespace tessera::parallel {

enum class OnebitScale { l1, l2 };
// "l1" or "l2"; anything else is an Error naming `where` and the value.
OnebitScale parse_onebit_scale(const std::string& name, const std::string& where);
const char* onebit_scale_name(OnebitScale scale);

// numel rounded up to a multiple of 8 x `ranks` (whole bytes of signs in every chunk).
int64_t onebit_padded(int64_t numel, int ranks);

void onebit_all_reduce(Communicator& comm, const Tensor& x, const Tensor& worker_error,
                       const Tensor& server_error, OnebitScale scale = OnebitScale::l1);
// The same for several tensors at once (same dtype and device), each with its own scales
// and errors, bitwise what one call per tensor gives, in 4 collectives instead of 4 per
// tensor: rank j's piece of the all-to-all carries chunk j of every tensor, and the scales
// travel as one [tensors] vector per rank.
void onebit_all_reduce_many(Communicator& comm, const std::vector<Tensor>& xs,
                            const std::vector<Tensor>& worker_errors,
                            const std::vector<Tensor>& server_errors,
                            OnebitScale scale = OnebitScale::l1);

}  // namespace tessera::parallel
