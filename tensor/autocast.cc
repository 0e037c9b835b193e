#include "tensor/autocast.h"

#include <array>

namespace tessera {
namespace {

thread_local DType t_autocast = DType::f32;

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

Tensor cast_to(const Tensor& t, DType d) {
  Attrs a;
  a.dtype = d;
  return call1(OpId::cast, {t}, a);
}

}  // namespace

AutocastRule autocast_rule(OpId op) { return kRules[static_cast<int>(op)]; }
DType autocast_dtype() { return t_autocast; }

AutocastGuard::AutocastGuard(DType low) : previous_(t_autocast) {
  TS_CHECK(low == DType::f32 || is_low(low),
           "AutocastGuard: the low-precision dtype must be bf16 or f16 (or f32 for off), got {}",
           low);
  t_autocast = low;
}
AutocastGuard::~AutocastGuard() { t_autocast = previous_; }

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
  autocast_inputs_with(op, inputs, cast_to);
}

}  // namespace tessera
