// Compressed saved activations (ActNN, Chen et al. 2021; Gist, Jain et al. 2018): the tensors
// autograd keeps for backward held in 8 bits with a scale per block of 256 elements, or in
// bf16, and decompressed when backward reads them. Activation memory drops ~4x (int8) or 2x
// (bf16) for f32 models; gradients change by the rounding (int8: at most half a step of
// absmax / 127 per element of each saved tensor).
//
//   autograd::SavedCompressionGuard g({.mode = SavedCompression::int8});
//   Tensor loss = model.forward(x);   // tensors saved here are compressed
//   loss.backward();                  // and decompressed here (the guard may be gone)
//
// What is compressed: floating tensors (f32, f64, f16, bf16) of at least min_numel elements,
// except leaves that require grad (parameters) and tensors made from them by views, casts and
// copies only (a transposed weight, autocast's bf16 copy of it): those stay alive anyway, and
// compressing them would only round the weights in backward. Tensors sharing storage with one
// in `exclude` are kept too. Integer and bool tensors (indices, masks) are kept as they are.
// The setting is per thread, like grad mode: each rank's thread sets its own.
//
// int8: a tensor's elements (flattened, row-major) in blocks of 256, each block with its
// absmax a (in the tensor's compute dtype: f64 for f64, f32 otherwise) and one code per
// element c = floor(x / (a / 127) + 127.5) in [0, 254]; decompressed as (c - 127) x (a / 127),
// within a / 254 of x, plus one rounding to a 16-bit tensor's dtype (a block of zeros stays
// zeros; a block holding an inf or a NaN comes back NaN). bf16: the tensor rounded to bf16
// (a 16-bit tensor is kept as it is). Tensors whose packing would not be smaller (expanded
// views, views of a smaller storage) are kept as they are.
//
// Recomputation (autograd/checkpoint.h) keeps its inputs exact and replays uncompressed:
// what it saves is read right away.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_set>
#include <vector>

#include "tensor/tensor.h"

namespace tessera::autograd {

struct SavedCompression {
  enum Mode : uint8_t { none, int8, bf16 };
  Mode mode = none;
  int64_t min_numel = 4096;  // smaller tensors are saved as they are
};

const char* saved_compression_name(SavedCompression::Mode mode);
// "none", "int8" or "bf16"; Error naming the flag and the choices otherwise.
SavedCompression::Mode parse_saved_compression(const std::string& name, const char* flag);

// Sets this thread's compression of saved tensors for its lifetime (and restores the previous
// setting): tensors saved for backward while it lives are compressed; parameters and the
// tensors in `exclude` (by storage) never are.
class SavedCompressionGuard {
 public:
  explicit SavedCompressionGuard(SavedCompression setting, const std::vector<Tensor>& exclude = {});
  ~SavedCompressionGuard();
  SavedCompressionGuard(const SavedCompressionGuard&) = delete;
  SavedCompressionGuard& operator=(const SavedCompressionGuard&) = delete;

  struct State;  // the setting and the excluded storages (saved_compression.cc)

 private:
  std::shared_ptr<const State> previous_;
};

// A tensor as it is kept for backward: compressed when this thread's setting says so.
struct PackedTensor {
  Tensor data;     // the tensor itself (uncompressed), or the codes (u8) / the bf16 copy
  Tensor scale;    // int8: the blocks' absmax / 127, [blocks]
  Shape shape;     // the original's shape and dtype
  DType dtype = DType::f32;
  SavedCompression::Mode mode = SavedCompression::none;
  // Bytes this packing holds (data + scale).
  int64_t bytes() const;
};

// int8 packs and unpacks this many blocks at a time (2^24 elements): the temporaries in the
// compute dtype stay that size however large the tensor.
inline constexpr int64_t kSavedChunkBlocks = int64_t{1} << 16;

// Packs `t` (detached) under this thread's setting; the caller keeps the storage version.
PackedTensor pack_saved(const Tensor& t);
// `t` (detached) kept as it is, whatever the setting.
PackedTensor keep_saved(const Tensor& t);
// The tensor again: `data` itself when uncompressed, else a new contiguous tensor of the
// original's shape and dtype on its device.
Tensor unpack_saved(const PackedTensor& p, int64_t chunk_blocks = kSavedChunkBlocks);

// The same two steps for any tensor, independent of the thread's setting (tests, tools).
PackedTensor compress_int8(const Tensor& t, int64_t chunk_blocks = kSavedChunkBlocks);
PackedTensor compress_bf16(const Tensor& t);

}  // namespace tessera::autograd
