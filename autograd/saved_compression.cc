#include "autograd/saved_compression.h"

#include <algorithm>
#include <string>

#include "autograd/node.h"
#include "tensor/error.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::autograd {

struct SavedCompressionGuard::State {
  SavedCompression setting;
  std::unordered_set<const StorageImpl*> exclude;
  std::vector<Storage> keep;  // the excluded storages alive, so no other takes their address
};

namespace {

constexpr int64_t kBlock = 256;
thread_local std::shared_ptr<const SavedCompressionGuard::State> t_state;

bool is_float(DType dt) {
  return dt == DType::f32 || dt == DType::f64 || dt == DType::f16 || dt == DType::bf16;
}

// The dtype the int8 arithmetic runs in: f64 for f64, f32 for the others.
DType compute_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

}  // namespace

const char* saved_compression_name(SavedCompression::Mode mode) {
  switch (mode) {
    case SavedCompression::none: return "none";
    case SavedCompression::int8: return "int8";
    case SavedCompression::bf16: return "bf16";
  }
  return "?";
}

SavedCompression::Mode parse_saved_compression(const std::string& name, const char* flag) {
  if (name == "none") return SavedCompression::none;
  if (name == "int8") return SavedCompression::int8;
  if (name == "bf16") return SavedCompression::bf16;
  fail("{}: '{}' is not a compression of saved activations; choose none, int8 or bf16", flag,
       name);
}

SavedCompressionGuard::SavedCompressionGuard(SavedCompression setting,
                                             const std::vector<Tensor>& exclude)
    : previous_(t_state) {
  TS_CHECK(setting.min_numel >= 0, "SavedCompressionGuard: min_numel is {}, must be >= 0",
           setting.min_numel);
  auto state = std::make_shared<State>();
  state->setting = setting;
  for (const Tensor& t : exclude) {
    if (t.defined() && state->exclude.insert(t.storage().get()).second) {
      state->keep.push_back(t.storage());
    }
  }
  t_state = std::move(state);
}

SavedCompressionGuard::~SavedCompressionGuard() { t_state = previous_; }

int64_t PackedTensor::bytes() const {
  int64_t b = 0;
  for (const Tensor* t : {&data, &scale}) {
    if (t->defined()) b += t->numel() * static_cast<int64_t>(dtype_size(t->dtype()));
  }
  return b;
}

PackedTensor compress_int8(const Tensor& t, int64_t chunk_blocks) {
  NoGradGuard no_grad;
  TS_CHECK(is_float(t.dtype()), "compress_int8: a {} tensor; only floating tensors compress",
           dtype_name(t.dtype()));
  TS_CHECK(chunk_blocks > 0, "compress_int8: chunk_blocks is {}, must be > 0", chunk_blocks);
  const DType cd = compute_dtype(t.dtype());
  const int64_t n = t.numel(), blocks = (n + kBlock - 1) / kBlock;
  const Tensor src = t.contiguous().reshape({n});
  PackedTensor p;
  p.data = Tensor::empty({blocks * kBlock}, DType::u8, t.device());
  p.scale = Tensor::empty({blocks}, cd, t.device());
  p.shape = t.shape();
  p.dtype = t.dtype();
  p.mode = SavedCompression::int8;
  const Tensor zero = full({}, 0.0, cd), one = full({}, 1.0, cd);
  const Tensor code_127 = full({}, 127.0, cd), code_254 = full({}, 254.0, cd);
  // Chunks of blocks, so the temporaries (the compute dtype's copy and its steps) stay a
  // chunk's size however large the tensor (a bf16 model's logits).
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
    const int64_t nb = std::min(chunk_blocks, blocks - b0), e0 = b0 * kBlock;
    const int64_t len = std::min(n, (b0 + nb) * kBlock) - e0, pad = nb * kBlock - len;
    Tensor flat = cast(src.narrow(0, e0, len), cd);
    if (pad > 0) flat = cat({flat, zeros({pad}, cd, t.device())});
    const Tensor x = flat.reshape({nb, kBlock});
    const Tensor step = max(abs(x), {1}, /*keepdim=*/true) / 127.0;  // [nb, 1]
    // A block of zeros divides by 1 (its codes are then 127, its values 0 again).
    const Tensor divisor = where(gt(step, zero), step, one);
    // In [0.5, 254.5] for finite x: the cast truncates, so this is floor(x / step + 127.5).
    // NaN (a block with an inf or a NaN) gets code 127; such a block comes back as NaN
    // (0 x inf), so an overflow stays visible to loss scaling. Clamped to [0, 254], so the
    // cast never sees a value out of range: a subnormal absmax / 127 loses precision (such a
    // block's values come back within its absmax, below 2^-126, not half a step), and a NaN
    // block's other elements are divided by 1.
    Tensor y = x / divisor + 127.5;
    y = where(eq(y, y), y, code_127);
    y = minimum(maximum(y, zero), code_254);
    p.data.narrow(0, e0, nb * kBlock).copy_(cast(y, DType::u8).reshape({nb * kBlock}));
    p.scale.narrow(0, b0, nb).copy_(step.reshape({nb}));
  }
  return p;
}

PackedTensor compress_bf16(const Tensor& t) {
  NoGradGuard no_grad;
  TS_CHECK(is_float(t.dtype()), "compress_bf16: a {} tensor; only floating tensors compress",
           dtype_name(t.dtype()));
  PackedTensor p;
  p.shape = t.shape();
  p.dtype = t.dtype();
  if (t.dtype() == DType::bf16 || t.dtype() == DType::f16) {
    p.data = t;  // already 16 bits
    return p;
  }
  p.data = cast(t, DType::bf16);
  p.mode = SavedCompression::bf16;
  return p;
}

namespace {

// Whether op `name` only moves or converts its input 0 (a view, a cast, a copy): a tensor made
// from a parameter by such ops (autocast's bf16 weight, a transposed weight) is the parameter.
bool passes_through(const std::string& name) {
  static const std::unordered_set<std::string> names = [] {
    std::unordered_set<std::string> n;
    for (const OpInfo& info : all_ops()) {
      if (info.family == OpFamily::View || info.family == OpFamily::Copy) n.insert(std::string(info.name));
    }
    return n;
  }();
  return names.count(name) > 0;
}

// t is a leaf that requires grad, or its storage is excluded, or it is made from a leaf that
// requires grad by views, casts and copies only.
bool excluded(const Tensor& t, const SavedCompressionGuard::State& s) {
  if (s.exclude.count(t.storage().get()) > 0 || (t.is_leaf() && t.requires_grad())) return true;
  std::shared_ptr<Node> node = t.grad_fn();
  for (int depth = 0; node != nullptr && depth < 16; ++depth) {
    if (dynamic_cast<const AccumulateGrad*>(node.get()) != nullptr) return true;
    if (!passes_through(node->name()) || node->next_edges().empty()) return false;
    node = node->next_edges()[0].fn;
  }
  return false;
}

}  // namespace

// Packing would not save memory: an expanded view (its storage holds fewer elements than the
// tensor has), or a tensor whose storage is smaller than the packing (int8: 1 + 1/64 bytes
// per element for f32 scales; bf16: 2).
static bool packing_grows(const Tensor& t, SavedCompression::Mode mode) {
  for (int64_t st : t.strides()) {
    if (st == 0) return true;
  }
  const double per_element = mode == SavedCompression::int8
                                 ? 1.0 + static_cast<double>(dtype_size(compute_dtype(t.dtype()))) / 256
                                 : 2.0;
  return static_cast<double>(t.storage()->nbytes()) <= per_element * static_cast<double>(t.numel());
}

PackedTensor keep_saved(const Tensor& t) {
  PackedTensor p;
  p.data = t.detach();
  p.shape = t.shape();
  p.dtype = t.dtype();
  return p;
}

PackedTensor pack_saved(const Tensor& t) {
  const SavedCompressionGuard::State* s = t_state.get();
  if (s == nullptr || s->setting.mode == SavedCompression::none || !is_float(t.dtype()) ||
      t.numel() < std::max<int64_t>(s->setting.min_numel, 1) || excluded(t, *s) ||
      packing_grows(t, s->setting.mode)) {
    return keep_saved(t);
  }
  const Tensor d = t.detach();
  return s->setting.mode == SavedCompression::int8 ? compress_int8(d) : compress_bf16(d);
}

Tensor unpack_saved(const PackedTensor& p, int64_t chunk_blocks) {
  if (p.mode == SavedCompression::none) return p.data;
  NoGradGuard no_grad;
  if (p.mode == SavedCompression::bf16) return cast(p.data, p.dtype);
  TS_CHECK(chunk_blocks > 0, "unpack_saved: chunk_blocks is {}, must be > 0", chunk_blocks);
  const DType cd = compute_dtype(p.dtype);
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  const int64_t blocks = p.scale.numel();
  const Tensor out = Tensor::empty({n}, p.dtype, p.data.device());
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
    const int64_t nb = std::min(chunk_blocks, blocks - b0), e0 = b0 * kBlock;
    const int64_t len = std::min(n, (b0 + nb) * kBlock) - e0;
    const Tensor codes = cast(p.data.narrow(0, e0, nb * kBlock), cd).reshape({nb, kBlock});
    const Tensor x = (codes - 127.0) * p.scale.narrow(0, b0, nb).reshape({nb, 1});
    out.narrow(0, e0, len).copy_(cast(x.reshape({nb * kBlock}).narrow(0, 0, len), p.dtype));
  }
  return out.reshape(p.shape);
}

}  // namespace tessera::autograd
