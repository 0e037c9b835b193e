#include "tensor/autocast.h"

#include <array>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "tensor/op_attrs.h"

namespace tessera {
namespace {

thread_local DType t_autocast = DType::f32;

// The cast cache (autocast.h): per thread, keyed by the source view (storage, offset, shape,
// strides) and the target dtype. An entry keeps the source's storage weakly (a dead or
// replaced storage never matches) and the cast's tensor strongly.
struct CastEntry {
  std::weak_ptr<StorageImpl> storage;
  const void* bytes;  // the storage's data when cast: a release and reallocation changes it
  uint64_t version;
  Tensor cast;  // detached: each reuse is a fresh handle with its own graph node
  uint64_t cast_version;
};
using CastKey = std::tuple<const StorageImpl*, int64_t, Shape, Strides, DType>;
CastKey key_of(const Tensor& src, DType dtype) {
  return {src.storage().get(), src.offset(), src.shape(), src.strides(), dtype};
}
struct CastCache {
  std::map<CastKey, CastEntry> entries;
  int holders = 0;
  bool off = false;      // an AutocastGuard(low, false) region
  bool casting = false;  // inside autocast's own cast (AutocastCastScope)
  int64_t hits = 0, misses = 0;
};
thread_local CastCache t_cast_cache;

void hold_cast_cache() { ++t_cast_cache.holders; }
void release_cast_cache() {
  if (--t_cast_cache.holders == 0) t_cast_cache.entries.clear();
}

bool entry_serves(const CastEntry& e, const Tensor& src) {
  const std::shared_ptr<StorageImpl> storage = e.storage.lock();
  return storage != nullptr && storage == src.storage() && storage->data() == e.bytes &&
         storage->version() == e.version && e.cast.storage()->version() == e.cast_version;
}

constexpr OpFamily kFamilies[] = {
#define TS_OP_FAMILY(name, kind, grad, family, props) OpFamily::family,
    TS_OP_LIST(TS_OP_FAMILY)
#undef TS_OP_FAMILY
};

// One table, keyed by the op list. Binary and comparison families promote mixed float
// inputs; the ops named below have their own rule; the rest keep their inputs.
constexpr std::array<AutocastRule, kNumOps> make_rules() {
  std::array<AutocastRule, kNumOps> r{};
  for (int i = 0; i < kNumOps; ++i) {
    const OpFamily f = kFamilies[i];
    const bool binary = f == OpFamily::Binary || f == OpFamily::BinaryFloat || f == OpFamily::Compare;
    r[i] = binary ? AutocastRule::promote : AutocastRule::keep;
  }
  for (OpId op : {OpId::matmul, OpId::linear, OpId::grouped_matmul, OpId::conv2d, OpId::attention,
                  OpId::attention_qkv}) {
    r[static_cast<int>(op)] = AutocastRule::lower;
  }
  for (OpId op : {OpId::sum, OpId::mean, OpId::var, OpId::softmax, OpId::log_softmax,
                  OpId::layer_norm, OpId::add_layer_norm, OpId::exp, OpId::log, OpId::pow}) {
    r[static_cast<int>(op)] = AutocastRule::to_f32;
  }
  for (OpId op : {OpId::where, OpId::cat, OpId::index_add, OpId::scatter_add}) {
    r[static_cast<int>(op)] = AutocastRule::promote;
  }
  return r;
}
constexpr std::array<AutocastRule, kNumOps> kRules = make_rules();

bool is_low(DType d) { return d == DType::f16 || d == DType::bf16; }
bool is_float(DType d) { return d == DType::f32 || d == DType::f64 || is_low(d); }
int width(DType d) { return d == DType::f64 ? 3 : d == DType::f32 ? 2 : 1; }

// For an op that reads its operands where they lie (matmul and linear, any strides: GPT's
// weights through transposed views), a view that permutes a dense block is cast in its
// storage order, then viewed back through the same permutation: a flat conversion instead of
// a transposing gather, and an operand in the source's layout (matmul takes it as
// transposed). The values and the logical shape are the same. In the backward the cast's
// gradient is also in storage order, so the parameter's gradient arrives in its own layout
// (no transposed copy). The cast cache sees the contiguous view of the source. Other ops
// (layer_norm, softmax, conv2d, ...) copy a strided input to contiguous anyway: for them the
// cast itself does the transpose, one pass instead of two.
bool reads_views(OpId op) { return op == OpId::matmul || op == OpId::linear; }

Tensor cast_to(const Tensor& t, DType d, bool in_storage_order) {
  Attrs a;
  a.dtype = d;
  const internal::AutocastCastScope autocast_cast;
  const std::vector<int64_t> order =
      in_storage_order ? dense_order(t.shape(), t.strides()) : std::vector<int64_t>{};
  if (order.empty()) return call1(OpId::cast, {t}, a);
  std::vector<int64_t> back(order.size());
  for (size_t i = 0; i < order.size(); ++i) back[order[i]] = static_cast<int64_t>(i);
  const Tensor in_order = call_view(OpId::permute, t, op_attrs::dims(order));
  return call_view(OpId::permute, call1(OpId::cast, {in_order}, a), op_attrs::dims(back));
}

}  // namespace

AutocastRule autocast_rule(OpId op) { return kRules[static_cast<int>(op)]; }
DType autocast_dtype() { return t_autocast; }

AutocastGuard::AutocastGuard(DType low, bool cache_casts)
    : previous_(t_autocast), previous_cache_off_(t_cast_cache.off),
      holds_(low != DType::f32 && cache_casts) {
  TS_CHECK(low == DType::f32 || is_low(low),
           "AutocastGuard: the low-precision dtype must be bf16 or f16 (or f32 for off), got {}",
           low);
  t_autocast = low;
  if (!cache_casts) t_cast_cache.off = true;
  if (holds_) hold_cast_cache();
}
AutocastGuard::~AutocastGuard() {
  t_autocast = previous_;
  t_cast_cache.off = previous_cache_off_;
  if (holds_) release_cast_cache();
}

WeightCastCache::WeightCastCache() { hold_cast_cache(); }
WeightCastCache::~WeightCastCache() { release_cast_cache(); }

void clear_cast_cache() { t_cast_cache.entries.clear(); }

CastCacheStats cast_cache_stats() {
  return {t_cast_cache.hits, t_cast_cache.misses, static_cast<int64_t>(t_cast_cache.entries.size())};
}

namespace internal {

AutocastCastScope::AutocastCastScope() : previous_(t_cast_cache.casting) { t_cast_cache.casting = true; }
AutocastCastScope::~AutocastCastScope() { t_cast_cache.casting = previous_; }

bool cast_cache_applies(const Tensor& src, DType dtype) {
  const CastCache& c = t_cast_cache;
  // (ZeRO-3's gathered units are released after each use: a cached cast would keep a
  // full-size copy of every unit alive, what gathering a unit at a time is there to avoid.)
  return c.casting && c.holders > 0 && !c.off && src.dtype() == DType::f32 && is_low(dtype) &&
         src.requires_grad() && src.storage() != nullptr && src.storage()->grad_leaf() &&
         src.storage()->tag() != MemoryTag::gathered;
}

Tensor cast_cache_find(const Tensor& src, DType dtype) {
  CastCache& c = t_cast_cache;
  const auto it = c.entries.find(key_of(src, dtype));
  if (it == c.entries.end() || !entry_serves(it->second, src)) {
    ++c.misses;
    return Tensor();
  }
  ++c.hits;
  return it->second.cast.detach();
}

void cast_cache_put(const Tensor& src, DType dtype, const Tensor& cast) {
  // Entries whose source died go first: a leaf that lives a micro-batch (a checkpointed
  // block's or a pipeline stage's detached input) then keeps its cast no longer than itself.
  std::erase_if(t_cast_cache.entries, [](const auto& e) { return e.second.storage.expired(); });
  const Storage& storage = src.storage();
  t_cast_cache.entries.insert_or_assign(
      key_of(src, dtype),
      CastEntry{storage, storage->data(), storage->version(), cast.detach(), cast.storage()->version()});
}

}  // namespace internal

std::vector<DType> autocast_dtypes(OpId op, const std::vector<DType>& dtypes, DType low) {
  std::vector<DType> out = dtypes;
  if (low == DType::f32) return out;
  switch (kRules[static_cast<int>(op)]) {
    case AutocastRule::keep:
      return out;
    case AutocastRule::lower:
      for (DType& d : out) {
        if (d == DType::f32) d = low;
      }
      return out;
    case AutocastRule::to_f32:
      for (DType& d : out) {
        if (is_low(d)) d = DType::f32;
      }
      return out;
    case AutocastRule::promote: {
      DType widest = DType::f32;
      bool any_float = false, mixed = false;
      for (DType d : dtypes) {
        if (!is_float(d)) continue;
        if (any_float && d != widest) mixed = true;
        if (!any_float || width(d) > width(widest)) widest = d;
        any_float = true;
      }
      if (!mixed) return out;
      if (is_low(widest)) widest = DType::f32;  // f16 with bf16: neither holds the other
      for (DType& d : out) {
        if (is_float(d)) d = widest;
      }
      return out;
    }
  }
  return out;
}

void autocast_inputs(OpId op, std::vector<Tensor>& inputs) {
  const bool in_storage_order = reads_views(op);
  autocast_inputs_with(op, inputs,
                       [&](const Tensor& t, DType d) { return cast_to(t, d, in_storage_order); });
}

}  // namespace tessera
