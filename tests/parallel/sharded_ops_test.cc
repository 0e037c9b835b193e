// Op x placement equivalence: every op in tensor/op_list.h, on 1-D meshes of 2 and 4 ranks
// and a 2 x 2 mesh (and 2 x 4 for matmul), with every combination of input placements,
// forward and backward: full_tensor() of each output, and each input's local gradient,
// equal the single-device result. The cases come from sharded_cases*.cc, keyed by the op
// list, so a new op fails the completeness test until it has a case and a sharding rule.
//
//   bazel test //tests/parallel:sharded_ops_test --test_arg=-sc=matmul   # one op
//
// Placements tried per mesh axis: a floating input takes Replicate, Shard(d) for every dim
// and Partial(sum); integer and bool inputs Replicate and Shard(d). All combinations run on
// the 1-D meshes; on 2-D meshes the combinations are the product over both axes, and a
// case with more than kMaxCombos of them runs a fixed, seeded sample of kMaxCombos. On
// 1-D meshes Partial(avg), Partial(max) and Partial(min) inputs run too (a seeded sample
// of at most kMaxExtended combinations with at least one of them). In-place ops keep the
// written inputs on one shared Replicate/Shard placement (the rule may not move them);
// factories try every output placement. Every case runs in f64 on every mesh and in f32
// on the 1-D meshes.
//
// Partial inputs are non-trivial: the terms on a Partial(sum) axis are random, coordinate
// 0 holding the value minus the others; Partial(avg) terms are the value plus random
// offsets summing to 0; Partial(max)/(min) put the value at coordinate 0 and smaller
// (larger) terms elsewhere. So a rule that passes a Partial input through a nonlinear op
// is caught. The expected local gradient of a term is the whole gradient (sum), 1/n of it
// (avg), or all of it at coordinate 0 and none elsewhere (max, min).
//
// Tolerances: |got - want| <= rel * (|want| + max|want|), rel = 1e-12 for f64 (sums of a
// few dozen terms in another order, plus the rounding of Partial terms adding up) and 1e-5
// for f32 (the same at 2^-24), taking the coarser of the output's and the inputs' dtype;
// integer and bool outputs exactly.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "autograd/derivatives.h"
#include "autograd/engine.h"
#include "parallel/comm/threads.h"
#include "parallel/ops.h"
#include "parallel/sharding_rule.h"
#include "tensor/autocast.h"
#include "tensor/error.h"
#include "tensor/op_attrs.h"
#include "tensor/ops.h"
#include "tests/parallel/sharded_cases.h"
#include "tests/reference/cases.h"

namespace tessera::parallel::testing {
namespace {

constexpr int64_t kMaxCombos = 2000;
constexpr int64_t kMaxExtended = 200;

struct MeshSpec {
  const char* name;
  std::vector<MeshAxis> axes;
  int world;
};
const MeshSpec kN2{"{n: 2}", {{"n", 2}}, 2};
const MeshSpec kN4{"{n: 4}", {{"n", 4}}, 4};
const MeshSpec k2x2{"{a: 2, b: 2}", {{"a", 2}, {"b", 2}}, 4};
const MeshSpec k2x4{"{a: 2, b: 4}", {{"a", 2}, {"b", 4}}, 8};

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 29);
}

bool floating(DType dt) { return dt == DType::f32 || dt == DType::f64 || dt == DType::f16 || dt == DType::bf16; }

// ---- input values -----------------------------------------------------------------------

Tensor values_tensor(const std::vector<double>& v, const Shape& shape, DType dt) {
  return Tensor::from_vector<double>(v, shape).cast(dt);
}

// One way of drawing values for every runner: the op sweep's draw().
Tensor draw(const InputSpec& s, DType case_dtype, uint64_t seed) {
  const DType dt = s.floating ? case_dtype : s.dtype;
  return sweep::make_tensor(sweep::draw(sweep::arg(s.shape, s.domain), dt, seed), dt);
}

// A Partial term's random part: integers for integer-valued inputs (exact sums).
Tensor noise(const Tensor& like, bool integer_valued, uint64_t seed, bool magnitude) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> ints(-3, 3);
  std::vector<double> v(static_cast<size_t>(like.numel()));
  for (double& x : v) {
    x = integer_valued ? ints(rng) : normal(rng);
    if (magnitude) x = (integer_valued ? 1.0 : 0.25) + std::fabs(x);
  }
  return values_tensor(v, like.shape(), like.dtype());
}

// The term this rank holds of `full` under placements `p` (before slicing).
Tensor partial_term(const Tensor& full, const DeviceMesh& mesh, const Placements& p,
                    bool integer_valued, uint64_t seed) {
  std::vector<int> axes;
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (p[a].is_partial()) axes.push_back(a);
  }
  if (axes.empty()) return full;
  bool all_sum = true;
  for (int a : axes) all_sum = all_sum && p[a].is_partial(ReduceOp::sum);
  if (all_sum) {
    // Tuples of coordinates on the Partial axes; tuple 0 holds the value minus the rest.
    int64_t tuples = 1, mine = 0;
    for (int a : axes) {
      tuples *= mesh.size(a);
      mine = mine * mesh.size(a) + mesh.coordinate(a);
    }
    if (mine != 0) return noise(full, integer_valued, mix(seed, mine), false);
    Tensor rest = tessera::zeros_like(full);
    for (int64_t t = 1; t < tuples; ++t) rest = rest + noise(full, integer_valued, mix(seed, t), false);
    return full - rest;
  }
  TS_CHECK(axes.size() == 1, "sharded_ops_test: avg/max/min Partial on one axis only");
  const int a = axes[0];
  const int64_t c = mesh.coordinate(a), n = mesh.size(a);
  switch (p[a].op) {
    case ReduceOp::avg: {
      if (c != 0) return full + noise(full, integer_valued, mix(seed, c), false);
      Tensor rest = tessera::zeros_like(full);
      for (int64_t t = 1; t < n; ++t) rest = rest + noise(full, integer_valued, mix(seed, t), false);
      return full - rest;
    }
    case ReduceOp::max:
      return c == 0 ? full : full - noise(full, integer_valued, mix(seed, c), true);
    case ReduceOp::min:
      return c == 0 ? full : full + noise(full, integer_valued, mix(seed, c), true);
    default:
      return full;
  }
}

Tensor block_of(const Tensor& t, const DeviceMesh& mesh, const Placements& p) {
  const LocalBlock b = local_block(t.shape(), mesh, p);
  Tensor local = t;
  for (int64_t d = 0; d < t.dim(); ++d) local = local.narrow(d, b.starts[d], b.shape[d]);
  return local;
}

// The share of the whole gradient that a term under `p` receives on this rank.
double gradient_share(const DeviceMesh& mesh, const Placements& p) {
  double share = 1.0;
  for (int a = 0; a < mesh.ndim(); ++a) {
    if (p[a].is_partial(ReduceOp::avg)) share /= static_cast<double>(mesh.size(a));
    if ((p[a].is_partial(ReduceOp::max) || p[a].is_partial(ReduceOp::min)) && mesh.coordinate(a) != 0) {
      share = 0.0;
    }
  }
  return share;
}

Placements without_partial(Placements p) {
  for (Placement& x : p) {
    if (x.is_partial()) x = Replicate();
  }
  return p;
}

// ---- comparison ---------------------------------------------------------------------------

double tolerance_of(DType dt) { return dt == DType::f64 ? 1e-12 : dt == DType::f32 ? 1e-5 : 1e-2; }

// "" when equal within tolerance; otherwise what differs.
std::string compare(const Tensor& got, const Tensor& want, DType case_dtype) {
  if (got.defined() != want.defined()) {
    return fmt::format("defined {} but single-device {}", got.defined(), want.defined());
  }
  if (!got.defined()) return "";
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) {
    return fmt::format("{} {} but single-device {} {}", shape_str(got.shape()), got.dtype(),
                       shape_str(want.shape()), want.dtype());
  }
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  double scale = 0.0;
  for (double x : w) {
    if (std::isfinite(x)) scale = std::max(scale, std::fabs(x));
  }
  // The inputs' precision bounds the output's too (an f32 Partial input cast to f64 is its
  // terms' f64 sum, which differs from the f32 value by a rounding).
  const double rel = floating(want.dtype())
                         ? std::max(tolerance_of(want.dtype()), tolerance_of(case_dtype))
                         : 0.0;
  double worst = -1.0;
  size_t at = 0, wrong = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (g[i] == w[i] || (std::isnan(g[i]) && std::isnan(w[i]))) continue;
    const double err = std::isnan(g[i] - w[i]) ? INFINITY : std::fabs(g[i] - w[i]);
    if (err <= rel * (std::fabs(w[i]) + scale)) continue;
    ++wrong;
    if (err > worst) worst = err, at = i;
  }
  if (wrong == 0) return "";
  return fmt::format("{} of {} elements differ; max error {:.3g} at flat index {}: got {} want {} "
                     "(tolerance {:.3g} x (|want| + {:.3g}))",
                     wrong, w.size(), worst, at, g[at], w[at], rel, scale);
}

// ---- failures -----------------------------------------------------------------------------

struct Failure {
  std::string where;   // case, mesh, dtype, placements, what
  std::string detail;  // the first rank's message
  std::set<int> ranks;
};

class Failures {
 public:
  void add(const std::string& where, const std::string& detail, int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, inserted] = index_.try_emplace(where, list_.size());
    if (inserted) list_.push_back(Failure{where, detail, {}});
    list_[it->second].ranks.insert(rank);
  }
  const std::vector<Failure>& list() const { return list_; }

 private:
  std::mutex mutex_;
  std::map<std::string, size_t> index_;
  std::vector<Failure> list_;
};

// ---- combinations ------------------------------------------------------------------------

// A slot is what one placement choice applies to: an input, the written inputs of an
// in-place op together, or a factory's output.
struct Slot {
  std::vector<size_t> inputs;
  std::vector<Placement> basic;     // every axis
  std::vector<Placement> extended;  // 1-D meshes: avg/max/min Partial too
};

std::vector<Slot> slots_of(const OpCase& c) {
  std::vector<Slot> slots;
  auto shard_options = [](int64_t rank, bool partial) {
    std::vector<Placement> o{Replicate()};
    for (int64_t d = 0; d < rank; ++d) o.push_back(Shard(d));
    if (partial) o.push_back(Partial(ReduceOp::sum));
    return o;
  };
  auto extend = [](std::vector<Placement> o) {
    for (ReduceOp op : {ReduceOp::avg, ReduceOp::max, ReduceOp::min}) o.push_back(Partial(op));
    return o;
  };
  if (c.is_factory) {
    Attrs a = c.attrs;
    a.dtype = DType::f64;
    const int64_t rank = static_cast<int64_t>(meta_fn(c.op) ? meta_fn(c.op)({}, a)[0].shape.size() : a.shape.size());
    Slot s{{}, shard_options(rank, true), {}};
    s.extended = extend(s.basic);
    return {s};
  }
  if (!c.written.empty()) {
    const int64_t rank =
        c.written_replicated ? 0 : static_cast<int64_t>(c.inputs[c.written[0]].shape.size());
    slots.push_back(Slot{c.written, shard_options(rank, false), shard_options(rank, false)});
  }
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const InputSpec& s = c.inputs[i];
    if (s.absent || std::find(c.written.begin(), c.written.end(), i) != c.written.end()) continue;
    Slot slot{{i}, shard_options(static_cast<int64_t>(s.shape.size()), s.floating), {}};
    slot.extended = s.floating ? extend(slot.basic) : slot.basic;
    slots.push_back(slot);
  }
  return slots;
}

// One combination: per slot, its placements (one per mesh axis).
using Combo = std::vector<Placements>;

Combo decode(const std::vector<Slot>& slots, int ndim, bool extended, int64_t index) {
  Combo combo(slots.size(), Placements(ndim));
  for (int a = ndim - 1; a >= 0; --a) {
    for (size_t s = slots.size(); s-- > 0;) {
      const auto& options = extended ? slots[s].extended : slots[s].basic;
      const int64_t n = static_cast<int64_t>(options.size());
      combo[s][a] = options[index % n];
      index /= n;
    }
  }
  return combo;
}

int64_t count_of(const std::vector<Slot>& slots, int ndim, bool extended) {
  int64_t n = 1;
  for (int a = 0; a < ndim; ++a) {
    for (const Slot& s : slots) n *= static_cast<int64_t>((extended ? s.extended : s.basic).size());
  }
  return n;
}

bool uses_extended(const Combo& combo) {
  for (const Placements& p : combo) {
    for (const Placement& x : p) {
      if (x.is_partial() && !x.is_partial(ReduceOp::sum)) return true;
    }
  }
  return false;
}

// Every combination, or a seeded sample (the same on every rank).
std::vector<Combo> combos_of(const OpCase& c, int ndim, uint64_t seed) {
  const std::vector<Slot> slots = slots_of(c);
  std::vector<Combo> out;
  const int64_t basic = count_of(slots, ndim, false);
  std::mt19937_64 rng(seed);
  if (basic <= kMaxCombos) {
    for (int64_t i = 0; i < basic; ++i) out.push_back(decode(slots, ndim, false, i));
  } else {
    std::set<int64_t> picked;
    std::uniform_int_distribution<int64_t> pick(0, basic - 1);
    while (static_cast<int64_t>(picked.size()) < kMaxCombos) picked.insert(pick(rng));
    for (int64_t i : picked) out.push_back(decode(slots, ndim, false, i));
  }
  if (ndim == 1) {
    const int64_t extended = count_of(slots, ndim, true);
    if (extended - basic <= kMaxExtended) {
      for (int64_t i = 0; i < extended; ++i) {
        Combo combo = decode(slots, ndim, true, i);
        if (uses_extended(combo)) out.push_back(std::move(combo));
      }
    } else {
      std::set<int64_t> picked;
      std::uniform_int_distribution<int64_t> pick(0, extended - 1);
      while (static_cast<int64_t>(picked.size()) < kMaxExtended) {
        const int64_t i = pick(rng);
        if (picked.count(i) == 0 && uses_extended(decode(slots, ndim, true, i))) picked.insert(i);
      }
      for (int64_t i : picked) out.push_back(decode(slots, ndim, true, i));
    }
  }
  return out;
}

std::string combo_str(const OpCase& c, const Combo& combo) {
  const std::vector<Slot> slots = slots_of(c);
  std::string s;
  for (size_t k = 0; k < slots.size(); ++k) {
    if (!s.empty()) s += " ";
    if (c.is_factory) {
      s += "out ";
    } else {
      s += "in";
      s += fmt::format("{}", fmt::join(slots[k].inputs, ","));
      s += " ";
    }
    s += placements_str(combo[k]);
  }
  return s;
}

// ---- the single-device reference ---------------------------------------------------------

struct Reference {
  Tensors inputs;   // full values (undefined: absent)
  Tensors outputs;  // detached
  Tensors weights;  // per output in the loss (undefined: not in it)
  Tensors grads;    // per input: d loss / d input (undefined: no gradient checked)
  bool backward = false;
  Attrs attrs;
};

bool in_loss(OpId op, size_t k, const Tensor& out) {
  if (!out.defined() || !floating(out.dtype()) || !op_info(op).differentiable) return false;
  const autograd::Derivative* d = autograd::derivative_for(op);
  return d == nullptr || (d->differentiable_outputs >> k & 1u) != 0;
}

Tensors run_single(const OpCase& c, const Tensors& in, const Attrs& a) {
  if (c.single) return c.single(in, a);
  if (op_info(c.op).kind == OpKind::View) return {call_view(c.op, in[0], a)};
  return tessera::call(c.op, in, a);
}

ShardedTensors run_sharded(const OpCase& c, const ShardedTensors& in, const Attrs& a) {
  if (c.sharded) return c.sharded(in, a);
  return parallel::call(c.op, in, a);
}

Tensor loss_of(const Tensors& outs, const Tensors& weights) {
  Tensor loss;
  for (size_t k = 0; k < outs.size(); ++k) {
    if (!weights[k].defined()) continue;
    Tensor term = tessera::sum(outs[k] * weights[k]);
    loss = loss.defined() ? loss + term : term;
  }
  return loss;
}

Reference reference(const OpCase& c, size_t case_index, DType dt) {
  Reference r;
  r.attrs = c.attrs;
  if (c.attrs_for) c.attrs_for(r.attrs, dt);
  const uint64_t seed = mix(static_cast<uint64_t>(c.op), case_index);
  if (c.is_factory) {
    r.outputs = {c.factory_single(r.attrs)};
    return r;
  }
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    r.inputs.push_back(c.inputs[i].absent ? Tensor() : draw(c.inputs[i], dt, mix(seed, i)));
  }
  if (c.prepare) c.prepare(r.inputs, dt);
  const bool diff = op_info(c.op).differentiable;
  Tensors args, leaves(r.inputs.size());
  for (size_t i = 0; i < r.inputs.size(); ++i) {
    const Tensor& x = r.inputs[i];
    if (x.defined() && diff && floating(x.dtype())) {
      leaves[i] = x.clone().requires_grad_();
      args.push_back(leaves[i]);
    } else {
      args.push_back(x.defined() ? x.clone() : x);
    }
  }
  const Tensors outs = run_single(c, args, r.attrs);
  r.weights.resize(outs.size());
  for (size_t k = 0; k < outs.size(); ++k) {
    r.outputs.push_back(outs[k].defined() ? outs[k].detach().clone() : Tensor());
    if (in_loss(c.op, k, outs[k])) {
      r.weights[k] = draw(in(outs[k].shape()), outs[k].dtype(), mix(seed, 1000 + k));
    }
  }
  const Tensor loss = loss_of(outs, r.weights);
  r.grads.resize(r.inputs.size());
  if (!loss.defined()) return r;
  r.backward = true;
  Tensors wrt;
  for (const Tensor& l : leaves) {
    if (l.defined()) wrt.push_back(l);
  }
  const Tensors g = autograd::grad({loss}, wrt);
  size_t j = 0;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (!leaves[i].defined()) continue;
    r.grads[i] = g[j].defined() ? g[j] : tessera::zeros_like(r.inputs[i]);
    ++j;
  }
  return r;
}

// ---- one combination on this rank ----------------------------------------------------------

struct Run {
  const OpCase& c;
  size_t case_index;
  DType dt;
  const MeshSpec& spec;
  const MeshPtr& mesh;
  const Reference& ref;
  Failures& failures;

  std::string where(const Combo& combo, const std::string& what) const {
    return fmt::format("{} [{}] on {} {}: {} :: {}", op_name(c.op), c.label, spec.name,
                       dtype_name(dt), combo_str(c, combo), what);
  }
  void fail(const Combo& combo, const std::string& what, const std::string& detail) const {
    failures.add(where(combo, what), detail, mesh->rank());
  }

  void check(const Combo& combo, const std::string& what, const Tensor& got, const Tensor& want) const {
    const std::string diff = compare(got, want, dt);
    if (!diff.empty()) fail(combo, what, diff);
  }

  void factory(const Combo& combo) const {
    const ShardedTensor out = c.factory_sharded(ref.attrs, mesh, combo[0]);
    check(combo, "forward output 0", out.full_tensor(), ref.outputs[0]);
  }

  void op(const Combo& combo) const {
    const std::vector<Slot> slots = slots_of(c);
    std::vector<Placements> placements(c.inputs.size(), replicated(*mesh));
    for (size_t s = 0; s < slots.size(); ++s) {
      for (size_t i : slots[s].inputs) placements[i] = combo[s];
    }
    const uint64_t seed = mix(mix(static_cast<uint64_t>(c.op), case_index), 77);
    ShardedTensors inputs(c.inputs.size());
    Tensors leaves(c.inputs.size());
    for (size_t i = 0; i < c.inputs.size(); ++i) {
      const Tensor& full = ref.inputs[i];
      if (!full.defined()) continue;
      const bool integer_valued = c.inputs[i].domain.kind == ref::Domain::Kind::integers;
      Tensor local =
          block_of(partial_term(full, *mesh, placements[i], integer_valued, mix(seed, i)), *mesh, placements[i])
              .clone();
      if (ref.backward && ref.grads[i].defined()) {
        local.requires_grad_();
        leaves[i] = local;
      }
      inputs[i] = from_local(local, mesh, placements[i], full.shape());
    }
    const ShardedTensors outs = run_sharded(c, inputs, ref.attrs);
    if (outs.size() != ref.outputs.size()) {
      fail(combo, "forward", fmt::format("{} outputs, single-device {}", outs.size(), ref.outputs.size()));
      return;
    }
    Tensors full_outs(outs.size());
    for (size_t k = 0; k < outs.size(); ++k) {
      if (outs[k].defined()) full_outs[k] = outs[k].full_tensor();
      check(combo, fmt::format("forward output {}", k), full_outs[k], ref.outputs[k]);
      if (!c.written.empty() && outs[k].defined()) {
        // Written in place: this rank's block itself, not only what full_tensor gathers.
        check(combo, fmt::format("written input {} (local block)", c.written[k]), outs[k].local(),
              block_of(ref.outputs[k], *mesh, outs[k].placements()));
      }
    }
    if (!ref.backward) return;
    Tensors weights = ref.weights;
    for (size_t k = 0; k < outs.size(); ++k) {
      if (weights[k].defined() && !full_outs[k].defined()) weights[k] = Tensor();
    }
    const Tensor loss = loss_of(full_outs, weights);
    if (!loss.defined() || !loss.requires_grad()) {
      fail(combo, "backward", "the sharded outputs carry no autograd graph");
      return;
    }
    Tensors wrt;
    for (const Tensor& l : leaves) {
      if (l.defined()) wrt.push_back(l);
    }
    const Tensors g = autograd::grad({loss}, wrt);
    size_t j = 0;
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (!leaves[i].defined()) continue;
      const Tensor got = g[j].defined() ? g[j] : tessera::zeros_like(leaves[i]);
      ++j;
      Tensor want = block_of(ref.grads[i], *mesh, without_partial(placements[i]));
      const double share = gradient_share(*mesh, placements[i]);
      if (share != 1.0) want = want * share;
      check(combo, fmt::format("gradient of input {} (local block)", i), got, want);
    }
  }
};

// Runs every case of `op` on `spec`'s mesh; returns the combinations tried (rank 0 counts).
struct Counts {
  std::map<std::string, int64_t> per_mesh;
};

void run_on_world(OpId op, const std::vector<OpCase>& cases, const std::vector<const MeshSpec*>& specs,
                  Failures& failures, Counts& counts) {
  const int world = specs.front()->world;
  std::mutex count_mutex;
  ThreadsOptions options;
  options.kernel_threads = 1;
  options.timeout_seconds = 10;
  try {
    run_threads(world, [&](CommPtr comm) {
      std::vector<MeshPtr> meshes;
      for (const MeshSpec* s : specs) meshes.push_back(make_mesh(comm, s->axes));
      for (size_t m = 0; m < specs.size(); ++m) {
        const MeshSpec& spec = *specs[m];
        for (size_t ci = 0; ci < cases.size(); ++ci) {
          const OpCase& c = cases[ci];
          if (spec.world == 8 && !c.mesh_2x4) continue;
          for (DType dt : {DType::f64, DType::f32}) {
            // f32 on the 1-D meshes only: the layouts are the same, f64 checks them tighter.
            if (dt == DType::f32 && (!c.f32 || spec.axes.size() > 1)) continue;
            Reference ref;
            try {
              ref = reference(c, ci, dt);
            } catch (const std::exception& e) {
              failures.add(fmt::format("{} [{}] {}: single-device reference", op_name(op), c.label,
                                       dtype_name(dt)),
                           e.what(), comm->rank());
              continue;
            }
            const Run run{c, ci, dt, spec, meshes[m], ref, failures};
            const std::vector<Combo> combos =
                combos_of(c, static_cast<int>(spec.axes.size()), mix(static_cast<uint64_t>(op), 1000 * ci + m));
            for (const Combo& combo : combos) {
              bool threw = false;
              try {
                if (c.is_factory) {
                  run.factory(combo);
                } else {
                  run.op(combo);
                }
              } catch (const std::exception& e) {
                threw = true;
                run.fail(combo, "threw", e.what());
              }
              // Every rank must have thrown or none: otherwise collectives no longer line up.
              Tensor flag = Tensor::from_vector<int64_t>({threw ? 1 : 0}, {1});
              comm->all_reduce(flag, ReduceOp::sum);
              const int64_t thrown = flag.item<int64_t>();
              if (thrown != 0 && thrown != world) {
                run.fail(combo, "ranks disagree", fmt::format("{} of {} ranks threw", thrown, world));
              }
            }
            if (comm->rank() == 0) {
              std::lock_guard<std::mutex> lock(count_mutex);
              counts.per_mesh[spec.name] += static_cast<int64_t>(combos.size());
            }
          }
        }
      }
    }, options);
  } catch (const std::exception& e) {
    failures.add(fmt::format("{} on a world of {}: aborted", op_name(op), world), e.what(), -1);
  }
}

const std::vector<OpCase>& table() {
  static const std::vector<OpCase> cases = sharded_cases();
  return cases;
}

std::vector<OpCase> cases_of(OpId op) {
  std::vector<OpCase> out;
  for (const OpCase& c : table()) {
    if (c.op == op) out.push_back(c);
  }
  return out;
}

void check_op(OpId op) {
  const std::vector<OpCase> cases = cases_of(op);
  REQUIRE_MESSAGE(!cases.empty(), op_name(op), " has no case in tests/parallel/sharded_cases*.cc");
  Failures failures;
  Counts counts;
  bool wants_2x4 = false;
  for (const OpCase& c : cases) wants_2x4 = wants_2x4 || c.mesh_2x4;
  run_on_world(op, cases, {&kN2}, failures, counts);
  run_on_world(op, cases, {&kN4, &k2x2}, failures, counts);
  if (wants_2x4) run_on_world(op, cases, {&k2x4}, failures, counts);

  int64_t total = 0;
  std::string per_mesh;
  for (const auto& [mesh, n] : counts.per_mesh) {
    total += n;
    per_mesh += fmt::format(" {} {}", mesh, n);
  }
  fmt::print("{:<24} {:>6} combinations:{}; {} failing\n", op_name(op), total, per_mesh, failures.list().size());
  CHECK_MESSAGE(total > 0, op_name(op), ": no placement combination ran");
  // TESSERA_SHARDED_SHOW=n shows n failures per op (default 8); world aborts come first.
  const char* shown_env = std::getenv("TESSERA_SHARDED_SHOW");
  const size_t kShown = shown_env != nullptr ? std::strtoul(shown_env, nullptr, 10) : 8;
  std::vector<Failure> list = failures.list();
  std::stable_partition(list.begin(), list.end(),
                        [](const Failure& f) { return f.where.find(": aborted") != std::string::npos; });
  for (size_t i = 0; i < std::min(list.size(), kShown); ++i) {
    const std::string ranks = fmt::format("{}", fmt::join(list[i].ranks, ","));
    FAIL_CHECK(list[i].where, " (ranks ", ranks, "): ", list[i].detail);
  }
  if (list.size() > kShown) {
    FAIL_CHECK(op_name(op), ": ", list.size() - kShown, " more failing combinations not shown");
  }
}

TEST_CASE("sharded ops: every op has a case and a sharding rule") {
  std::set<OpId> with_case;
  for (const OpCase& c : table()) with_case.insert(c.op);
  for (const OpInfo& info : all_ops()) {
    CHECK_MESSAGE(with_case.count(info.id) == 1, info.name,
                  ": no case in tests/parallel/sharded_cases*.cc");
    const ShardingRule* rule = sharding_rule_for(info.id);
    CHECK_MESSAGE(rule != nullptr, info.name, ": no sharding rule (parallel/rules_*.cc)");
    if (rule == nullptr) continue;
    if (info.kind == OpKind::Composite) {
      CHECK_MESSAGE(rule->composite, info.name, " is Composite: its rule must say composite = true");
    } else {
      const bool has_options = rule->options != nullptr;
      CHECK_MESSAGE(has_options, info.name, ": its sharding rule lists no options");
    }
  }
}

TEST_CASE("sharded ops: adamw8bit_ refuses written inputs that are not replicated") {
  // Its rule keeps param, codes and scales whole (a block's scale spans the block); ZeRO
  // shards at block boundaries itself. A sharded param must be an error on every rank.
  run_threads(2, [&](CommPtr world) {
    auto mesh = make_mesh(world, {{"n", 2}});
    auto rep = [&](const Tensor& t) { return distribute(t, mesh, {Replicate()}); };
    const ShardedTensor p = distribute(tessera::zeros({4, 8}), mesh, {Shard(0)});
    const ShardedTensors in = {p,
                               rep(tessera::zeros({4, 8})),
                               rep(tessera::zeros({4, 8}, DType::u8)),
                               rep(tessera::zeros({4, 8}, DType::u8)),
                               rep(tessera::zeros({1})),
                               rep(tessera::zeros({1}))};
    std::string msg;
    try {
      parallel::call_inplace(OpId::adamw8bit_, in, op_attrs::adamw(1, 0.1, 0.9, 0.999, 1e-8, 0.0),
                             {0, 2, 3, 4, 5});
    } catch (const Error& e) {
      msg = e.what();
    }
    CHECK_MESSAGE(msg.find("adamw8bit_: input 0 is written in place with placements [S(0)] but "
                           "the op needs [R]") != std::string::npos,
                  msg);
  });
}

TEST_CASE("sharded ops: forward and backward equal one device for every placement") {
  for (const OpInfo& info : all_ops()) {
    SUBCASE(std::string(info.name).c_str()) { check_op(info.id); }
  }
}

TEST_CASE("sharded ops: the named forms of parallel/ops.h equal tessera's on one device") {
  // Each named wrapper packs its attributes as tensor/ops.h does (tensor/op_attrs.h); f64
  // inputs split over 2 ranks, compared within 1e-12 (the same arithmetic, or sums in
  // another order).
  manual_seed(11);
  const Tensor x = randn({4, 6}, DType::f64), img = randn({2, 3, 6, 6}, DType::f64),
               w = randn({4, 3, 3, 3}, DType::f64), q = randn({2, 2, 5, 4}, DType::f64),
               k = randn({2, 2, 5, 4}, DType::f64), v = randn({2, 2, 5, 4}, DType::f64);
  const Tensor idx = Tensor::from_vector<int64_t>({2, 0, 5}, {3});
  const Tensor cond = gt(x, zeros({}, DType::f64));
  run_threads(2, [&](CommPtr world) {
    auto mesh = make_mesh(world, {{"n", 2}});
    const ShardedTensor sx = distribute(x, mesh, {Shard(0)});
    const ShardedTensor sidx = distribute(idx, mesh, {Replicate()});
    auto close = [](const ShardedTensor& got, const Tensor& want, const char* what) {
      CAPTURE(what);
      REQUIRE(got.shape() == want.shape());
      if (want.numel() == 0) return;
      CHECK(max(abs(cast(got.full_tensor(), DType::f64) - cast(want, DType::f64))).item<double>() <= 1e-12);
    };
    close(var(sx, {1}, 0), var(x, {1}, 0), "var");
    close(argmax(sx, 1), argmax(x, 1), "argmax");
    close(pow(abs(sx), 1.5), pow(abs(x), 1.5), "pow by a scalar");
    close(where(distribute(cond, mesh, {Shard(0)}), sx, neg(sx)), where(cond, x, neg(x)), "where");
    close(index_select(sx, 1, sidx), index_select(x, 1, idx), "index_select");
    close(index_add(sx, 1, sidx, distribute(ones({4, 3}, DType::f64), mesh, {Shard(0)})),
          index_add(x, 1, idx, ones({4, 3}, DType::f64)), "index_add");
    const Tensor gi = Tensor::from_vector<int64_t>({1, 0, 3, 5, 2, 2, 4, 1}, {4, 2});
    close(gather(sx, 1, distribute(gi, mesh, {Shard(0)})), gather(x, 1, gi), "gather");
    close(scatter_add(sx, 1, distribute(gi, mesh, {Shard(0)}), distribute(ones({4, 2}, DType::f64), mesh, {Shard(0)})),
          scatter_add(x, 1, gi, ones({4, 2}, DType::f64)), "scatter_add");
    const std::vector<ShardedTensor> tk = topk(sx, 2, 1);
    const std::vector<Tensor> tk1 = topk(x, 2, 1);
    close(tk[0], tk1[0], "topk values");
    close(tk[1], tk1[1], "topk indices");
    close(clone(sx), x, "clone");
    const ShardedTensor simg = distribute(img, mesh, {Shard(0)});
    close(conv2d(simg, distribute(w, mesh, {Replicate()}), {}, {1, 1}, {1, 1}),
          conv2d(img, w, Tensor(), {1, 1}, {1, 1}), "conv2d");
    close(max_pool2d(simg, {2, 2}), max_pool2d(img, {2, 2}), "max_pool2d");
    close(attention(distribute(q, mesh, {Shard(1)}), distribute(k, mesh, {Shard(1)}),
                    distribute(v, mesh, {Shard(1)}), true),
          attention(q, k, v, true), "attention");
  });
}

TEST_CASE("sharded ops: autocast applies to sharded tensors as to tensors") {
  // Under AutocastGuard(bf16), parallel::call casts the global inputs by the op's rule, so a
  // row-wise matmul of f32 blocks runs in bf16 and its bias add promotes, as on one device.
  manual_seed(12);
  const Tensor a = tessera::randn({4, 6}), b = tessera::randn({6, 5}), bias = tessera::randn({5});
  Tensor want;
  {
    AutocastGuard amp(DType::bf16);
    want = tessera::matmul(a, b) + bias;
  }
  REQUIRE(want.dtype() == DType::f32);
  run_threads(2, [&](CommPtr world) {
    auto mesh = make_mesh(world, {{"n", 2}});
    AutocastGuard amp(DType::bf16);
    const ShardedTensor product = matmul(distribute(a, mesh, {Shard(0)}), distribute(b, mesh, {Replicate()}));
    CHECK(product.dtype() == DType::bf16);
    const ShardedTensor got = product + distribute(bias, mesh, {Replicate()});
    CHECK(got.dtype() == DType::f32);
    CHECK(got.full_tensor().to_vector<double>() == want.to_vector<double>());
  });
}

}  // namespace
}  // namespace tessera::parallel::testing
