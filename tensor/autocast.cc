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
  for (OpId op : {OpId::matmul, OpId::conv2d, OpId::attention}) {
    r[static_cast<int>(op)] = AutocastRule::lower;
  }
  for (OpId op : {OpId::sum, OpId::mean, OpId::var, OpId::softmax, OpId::log_softmax,
                  OpId::layer_norm, OpId::cross_entropy, OpId::exp, OpId::log, OpId::pow}) {
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

void autocast_inputs(OpId op, std::vector<Tensor>& inputs) {
  const DType low = t_autocast;
  switch (kRules[static_cast<int>(op)]) {
    case AutocastRule::keep:
      return;
    case AutocastRule::lower:
      for (Tensor& t : inputs) {
        if (t.defined() && t.dtype() == DType::f32) t = cast_to(t, low);
      }
      return;
    case AutocastRule::to_f32:
      for (Tensor& t : inputs) {
        if (t.defined() && is_low(t.dtype())) t = cast_to(t, DType::f32);
      }
      return;
    case AutocastRule::promote: {
      DType widest = DType::f32;
      bool any_float = false, mixed = false;
      for (const Tensor& t : inputs) {
        if (!t.defined() || !is_float(t.dtype())) continue;
        if (any_float && t.dtype() != widest) mixed = true;
        if (!any_float || width(t.dtype()) > width(widest)) widest = t.dtype();
        any_float = true;
      }
      if (!mixed) return;
      if (is_low(widest)) widest = DType::f32;  // f16 with bf16: neither holds the other
      for (Tensor& t : inputs) {
        if (t.defined() && is_float(t.dtype()) && t.dtype() != widest) t = cast_to(t, widest);
      }
      return;
    }
  }
}

}  // namespace tessera
