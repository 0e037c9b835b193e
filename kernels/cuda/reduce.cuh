// Launchers of the CUDA reductions (reduce.cu): sum, mean, max, argmax and var over a set of
// dims, given as the input's kept and reduced dims (each group coalesced).
//
//   ReduceLayout l = ...;                              // reduce.cc: from the tensor and dims
//   if (!reduce_direct(l)) { ...copy with reduced dims last, rebuild l... }
//   Tensor ws = Tensor::empty({reduce_workspace_bytes(l)}, DType::b8, device);
//   launch_reduce(ReduceOp::sum, dev_tensor(out), dev_tensor(x), l, 1, ws.raw_data(), stream);
//
// Results are deterministic: the reduction order depends on the shapes only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/dev_tensor.h"

namespace tessera::cuda_kernels {

enum class ReduceOp : int { sum, mean, max, argmax, var };

// The input seen as [kept..., reduced...]: element strides of each group, size-1 dims dropped
// and neighbours merged. The output (contiguous) is indexed by the kept group's linear index.
struct ReduceLayout {
  int nkept = 0, nred = 0;
  int64_t ksizes[kMaxDims] = {}, kstrides[kMaxDims] = {};
  int64_t rsizes[kMaxDims] = {}, rstrides[kMaxDims] = {};
  int64_t nk = 1, nr = 1;  // kept and reduced element counts (before coalescing)
};

// True when the kernels read this layout as it is: the reduced elements of each output are
// one contiguous run (row reduction), or the innermost kept dim is contiguous (column
// reduction). Otherwise the caller packs the input with the reduced dims last first.
bool reduce_direct(const ReduceLayout& l);

// Scratch bytes launch_reduce needs for this layout (partial results of long reductions split
// across blocks); 0 when none.
int64_t reduce_workspace_bytes(const ReduceLayout& l);

// out (contiguous, nk elements) <- the reduction of `in` (its data pointer and dtype; the
// layout gives the strides). correction: var's. workspace: reduce_workspace_bytes of memory.
void launch_reduce(ReduceOp op, const DevTensor& out, const DevTensor& in, const ReduceLayout& l,
                   int64_t correction, void* workspace, cudaStream_t stream);

// sum_squares (the spec is kernels/cpu/reduce.cc): per tensor, blocks of kSquaresChunk
// elements' squares in f64 (a fixed tree each), folded in order into sums[t]; then sums[]
// in order into out (f64 []). Every x contiguous; `sums` holds xs.size() doubles, `partial`
// the sum of squares_blocks() over the xs. A few launches for any number of tensors (the
// blocks of up to 48 tensors in one). Deterministic: the same bits for the same tensors,
// however many are passed together (on the CPU it is also bitwise sum()'s).
constexpr int64_t kSquaresChunk = 1 << 14;
int64_t squares_blocks(int64_t numel);
void launch_sum_squares(const DevTensor& out, const std::vector<DevTensor>& xs, double* sums,
                        double* partial, cudaStream_t stream);

}  // namespace tessera::cuda_kernels
