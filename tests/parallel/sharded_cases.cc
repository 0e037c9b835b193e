// Sharded op cases: builders, elementwise ops, comparisons, reductions.
#include "tests/parallel/sharded_cases.h"

#include <algorithm>

#include "tensor/ops.h"
#include "tests/reference/op_cases.h"
#include "tests/reference/cases.h"

namespace tessera::parallel::testing {

namespace {
InputSpec spec(Shape shape, ref::Domain domain) {
  InputSpec s;
  s.shape = std::move(shape);
  s.domain = std::move(domain);
  return s;
}
InputSpec non_floating(Shape shape, ref::Domain domain, DType dtype) {
  InputSpec s = spec(std::move(shape), std::move(domain));
  s.dtype = dtype;
  s.floating = false;
  return s;
}
}  // namespace

InputSpec in(Shape shape, double scale) { return spec(std::move(shape), ref::normal(scale)); }
InputSpec positive(Shape shape, double lo, double hi) {
  return spec(std::move(shape), ref::uniform(lo, hi));
}
InputSpec away(Shape shape, double lo, double hi) { return spec(std::move(shape), ref::away(lo, hi)); }
InputSpec integers(Shape shape, int64_t lo, int64_t hi) {
  return spec(std::move(shape), ref::ints(lo, hi));
}
InputSpec index(Shape shape, int64_t lo, int64_t hi, DType dtype) {
  return non_floating(std::move(shape), ref::ints(lo, hi), dtype);
}
InputSpec boolean(Shape shape) { return non_floating(std::move(shape), ref::bools(), DType::b8); }
InputSpec fixed_index(Shape shape, std::vector<double> values, DType dtype) {
  return non_floating(std::move(shape), ref::fixed(std::move(values)), dtype);
}

InputSpec absent() {
  InputSpec s;
  s.absent = true;
  return s;
}

OpCase op_case(OpId op, std::string label, std::vector<InputSpec> inputs, Attrs attrs) {
  OpCase c;
  c.op = op;
  c.label = std::move(label);
  c.inputs = std::move(inputs);
  c.attrs = std::move(attrs);
  return c;
}

std::vector<OpCase> sharded_cases() {
  std::vector<OpCase> out;
  for (auto* family : {&elementwise_cases, &data_cases, &record_cases}) {
    for (OpCase& c : (*family)()) out.push_back(std::move(c));
  }
  std::stable_sort(out.begin(), out.end(), [](const OpCase& a, const OpCase& b) {
    return static_cast<int>(a.op) < static_cast<int>(b.op);
  });
  return out;
}

namespace {

// [5, 7]: uneven on 2 and 4 ranks; [2, 3, 5]: dims smaller than 4 (empty blocks).
const Shape kMatrix = {5, 7};
const Shape kCube = {2, 3, 5};

}  // namespace

std::vector<OpCase> elementwise_cases() {
  std::vector<OpCase> out;
  // The functor family ops, from their one test case each: unary ops on a [5, 7] and a
  // [2, 3, 5] input; binary ops and comparisons equal, broadcast both ways, 0-d.
  for (const ref::FunctorOpCase& fc : ref::functor_op_cases()) {
    auto a = [&](Shape s) { return spec(std::move(s), fc.a); };
    auto b = [&](Shape s) { return spec(std::move(s), fc.b); };
    if (fc.unary) {
      for (const Shape& s : {kMatrix, kCube}) out.push_back(op_case(fc.op, shape_str(s), {a(s)}));
      continue;
    }
    out.push_back(op_case(fc.op, "[5, 7] . [5, 7]", {a({5, 7}), b({5, 7})}));
    out.push_back(op_case(fc.op, "[3, 1, 5] . [4, 1] (broadcast)", {a({3, 1, 5}), b({4, 1})}));
    if (op_info(fc.op).family != OpFamily::Compare) {
      out.push_back(op_case(fc.op, "[5, 6] . 0-d", {a({5, 6}), b({})}));
    }
  }
  return out;
}

// ---- the cases read from every op's record ---------------------------------------------------
// A record's case runs here when it says so (Case::sharded, default true), runs the op itself
// (no `run` of its own: the sharded form is parallel::call, call_inplace for in-place ops,
// parallel::factory for factories), runs in f64, its floating
// inputs are drawn from continuous domains (fixed values and integer-valued floats are IEEE
// specials and ties, whose gradient is split differently by a rule that reduces in
// another order), and its inputs hold at most kMaxValues values (every placement of every
// input is tried). It runs in f64 and, when the case allows f32, in f32. Inputs keep the
// record's shapes, domains and `prepare`.
namespace {

constexpr int64_t kMaxValues = 300;

bool runs_here(const sweep::OpSweep& s, const sweep::Case& c) {
  if (!c.sharded || c.run) return false;
  if (!sweep::runs_in(s, c, DType::f64)) return false;
  int64_t values = 0;
  for (const sweep::Arg& a : c.args) {
    if (a.absent) continue;
    values += numel_of(a.shape);
    if (a.dtype) continue;
    const ref::Domain::Kind k = a.domain.kind;
    if (k == ref::Domain::Kind::fixed || k == ref::Domain::Kind::integers ||
        k == ref::Domain::Kind::nonzero_integers) {
      return false;
    }
  }
  return values <= kMaxValues;
}

}  // namespace

std::vector<OpCase> record_cases() {
  std::vector<OpCase> out;
  for (const sweep::OpSweep& s : sweep::all_sweeps()) {
    for (const sweep::Case& c : s.cases) {
      if (!runs_here(s, c)) continue;
      std::vector<InputSpec> inputs;
      for (const sweep::Arg& a : c.args) {
        if (a.absent) {
          inputs.push_back(absent());
        } else if (a.dtype) {
          inputs.push_back(non_floating(a.shape, a.domain, *a.dtype));
        } else {
          inputs.push_back(spec(a.shape, a.domain));
        }
      }
      OpCase oc = op_case(s.op, c.label, std::move(inputs), c.attrs);
      oc.mesh_2x4 = s.op == OpId::matmul;  // 8 ranks: both mesh axes shard its operands
      // In-place ops: the written inputs keep one shared placement and are the outputs.
      oc.written = sweep::written_inputs(s, c);
      oc.written_replicated = s.op == OpId::adamw8bit_ || s.op == OpId::adamw8bit_segments_ ||
                              s.op == OpId::adafactor_stats_ ||
                              s.op == OpId::adafactor_norm_ || s.op == OpId::adafactor_apply_;
      if (!oc.written.empty()) {
        oc.single = [op = s.op, w = oc.written](const Tensors& t, const Attrs& a) {
          if (op == OpId::copy_) {
            tessera::call_copy_(t[0], t[1]);
          } else {
            tessera::call_inplace(op, t, a, w);
          }
          Tensors out;
          for (size_t i : w) out.push_back(t[i]);
          return out;
        };
        oc.sharded = [op = s.op, w = oc.written](const ShardedTensors& t, const Attrs& a) {
          parallel::call_inplace(op, t, a, w);
          ShardedTensors out;
          for (size_t i : w) out.push_back(t[i]);
          return out;
        };
      }
      if (op_info(s.op).kind == OpKind::Factory) {  // every output placement is tried
        oc.is_factory = true;
        oc.attrs_for = [](Attrs& a, DType dt) { a.dtype = dt; };
        oc.factory_single = [op = s.op](const Attrs& a) { return tessera::call1(op, {}, a); };
        oc.factory_sharded = [op = s.op](const Attrs& a, const MeshPtr& mesh, const Placements& p) {
          return parallel::factory(op, a, mesh, p);
        };
      }
      oc.f32 = sweep::runs_in(s, c, DType::f32);
      if (c.prepare) {
        oc.prepare = [prepare = c.prepare](Tensors& in, DType dt) {
          sweep::Arrays vals;
          for (const Tensor& t : in) vals.push_back(t.defined() ? sweep::read_tensor(t) : ref::NdArray::absent());
          prepare(vals, dt);
          for (size_t i = 0; i < in.size(); ++i) {
            if (in[i].defined()) in[i] = sweep::make_tensor(ref::round_to(vals[i], in[i].dtype()), in[i].dtype());
          }
        };
      }
      out.push_back(std::move(oc));
    }
  }
  return out;
}

}  // namespace tessera::parallel::testing
