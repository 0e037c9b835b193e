// Mixed precision by op category (PyTorch's autocast): inside an AutocastGuard, matmul,
// linear (its bias too: the output is low-precision, as torch's linear) and conv2d run in
// the low-precision dtype (bf16 or f16), while reductions, softmax, log_softmax, layer_norm,
// exp/log and the loss run in f32; binary elementwise ops with mixed float
// operands run in the wider dtype. Casts are ordinary (differentiable) cast ops inserted by
// call(), so the weights stay f32 (the master copy) and their gradients come back f32.
// A permuted view of a dense block (GPT's tied head wte^T, its q/k/v weight transposed) going
// into matmul or linear is cast in its storage order and viewed back: a flat conversion, and
// the low-precision operand keeps the source's layout (same values; those ops read views).
//
//   { AutocastGuard amp(DType::bf16); loss = cross_entropy(model.forward(x), y); }
//   loss.backward();   // backward never autocasts: each derivative runs in its forward dtype
#pragma once

#include <span>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/op.h"

namespace tessera {

// How autocast treats an op's floating-point inputs.
enum class AutocastRule : uint8_t {
  keep,     // run as given (views, data movement, ops exact in any precision)
  lower,    // cast f32 inputs to the low-precision dtype (GEMM-bound ops)
  to_f32,   // cast f16/bf16 inputs to f32 (reductions, softmax, norms, the loss)
  promote,  // mixed float inputs: cast all to the widest (elementwise)
};

AutocastRule autocast_rule(OpId op);

// The low-precision dtype when autocast is on for this thread, else DType::f32 ("off").
DType autocast_dtype();
inline bool autocast_enabled() { return autocast_dtype() != DType::f32; }

// Turns autocast on with `low` (bf16 or f16), or off with f32, for its lifetime. A guard that
// turns it on holds the cast cache (below) open for its region; cache_casts = false turns the
// cache off inside the region instead (every cast runs, as before the cache existed).
class AutocastGuard {
 public:
  explicit AutocastGuard(DType low, bool cache_casts = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  DType previous_;
  bool previous_cache_off_;
  bool holds_;
};

// ---- the cast cache ---------------------------------------------------------------------------
// Autocast casts a parameter (a leaf tensor that requires grad, or a view of one: GPT's tied
// head multiplies by wte's transpose) to the low dtype once and reuses that cast while a
// holder is open on this thread: an AutocastGuard that turns autocast
// on (its region, as PyTorch's autocast caches within one), or a WeightCastCache, which the
// training loop holds across a step's micro-batches so that each weight is cast once a step
// instead of once per forward (not with recomputation, whose passes keep nothing). A reuse records its own cast in the graph, so
// the gradient reaches the f32 parameter as before; the values are the cast's, bit for bit.
// An entry serves only while the parameter's storage, bytes and version are those it was cast
// from: in-place ops, copy_ and the optimizers' fused updates bump the version, but a
// collective or a file read writing into a parameter's bytes does not, so such a writer calls
// clear_cast_cache() (ZeRO's step does). Only casts autocast inserts are served (an explicit
// cast() always runs), never of ZeRO-3's gathered units (released after each use), and an
// entry whose parameter died is dropped at the next cast. The cache is emptied when the
// thread's last holder closes. A region with cache_casts = false keeps it off in regions
// nested inside it.
//
//   WeightCastCache keep;                     // the step's micro-batches share the casts
//   for (int m = 0; m < accum; ++m) { AutocastGuard amp(DType::bf16); model(x[m]).backward(); }
class WeightCastCache {
 public:
  WeightCastCache();
  ~WeightCastCache();
  WeightCastCache(const WeightCastCache&) = delete;
  WeightCastCache& operator=(const WeightCastCache&) = delete;
};

// Drops this thread's cached casts. For code that writes parameters outside the op path
// (a collective or a file read into their bytes moves no version): ZeRO's step calls it.
void clear_cast_cache();

// This thread's cache: casts served from it, casts made into it, entries held now.
struct CastCacheStats {
  int64_t hits = 0, misses = 0, entries = 0;
};
CastCacheStats cast_cache_stats();

namespace internal {
// Marks the casts made in its lifetime as autocast's own (tensor and sharded dispatch).
class AutocastCastScope {
 public:
  AutocastCastScope();
  ~AutocastCastScope();
  AutocastCastScope(const AutocastCastScope&) = delete;
  AutocastCastScope& operator=(const AutocastCastScope&) = delete;

 private:
  bool previous_;
};
// For call(): whether this cast of `src` to `dtype` goes through the cache; the cached cast
// (undefined when there is none); storing a new one.
bool cast_cache_applies(const Tensor& src, DType dtype);
Tensor cast_cache_find(const Tensor& src, DType dtype);
void cast_cache_put(const Tensor& src, DType dtype, const Tensor& cast);
}  // namespace internal

// The dtypes `op`'s inputs take under autocast with low-precision dtype `low` (undefined
// inputs: unchanged), for any tensor type: tensors (call()) and sharded tensors
// (parallel::call) follow one policy.
std::vector<DType> autocast_dtypes(OpId op, const std::vector<DType>& dtypes, DType low);

// Applies the rule of `op` to its inputs in place (called by call() when autocast is on):
// `cast(t, dtype)` for each input whose dtype changes.
template <class T, class Cast>
void autocast_inputs_with(OpId op, std::vector<T>& inputs, Cast&& cast) {
  std::vector<DType> dtypes;
  for (const T& t : inputs) dtypes.push_back(t.defined() ? t.dtype() : DType::b8);  // (ignored)
  const std::vector<DType> want = autocast_dtypes(op, dtypes, autocast_dtype());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && want[i] != dtypes[i]) inputs[i] = cast(inputs[i], want[i]);
  }
}
void autocast_inputs(OpId op, std::vector<Tensor>& inputs);

}  // namespace tessera
