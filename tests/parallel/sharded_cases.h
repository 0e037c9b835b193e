// The case table of the sharded op equivalence test (sharded_ops_test.cc): per op in
// tensor/op_list.h, inputs (shapes and value domains), attributes, and how the op runs on
// one device and on sharded tensors. The harness tries every placement of every input on
// several meshes and compares with the single-device result.
//
// Most cases are read from the ops' records (tests/reference/cases.h; record_cases in
// sharded_cases.cc) and the functor family ops' FunctorOpCase; the rest are written here
// where a record cannot say how the sharded form runs:
//
//   OpCase c = op_case(OpId::stack, "3 x [2, 3] dim 0", {in({2, 3}), in({2, 3}), in({2, 3})});
//   c.single = ...; c.sharded = ...;   // only where the default call()s do not fit
//
// Shapes include dims not divisible by 2 or 4 (uneven blocks) and dims smaller than 4
// (empty blocks on 4 ranks).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "parallel/ops.h"
#include "tensor/op.h"
#include "tests/reference/op_cases.h"

namespace tessera::parallel::testing {

// An input: its shape and how its values are drawn (ref::Domain, the vocabulary of every
// runner; drawn by the op sweep's draw(), so every runner draws values the same way).
struct InputSpec {
  Shape shape;
  ref::Domain domain = ref::normal();
  DType dtype = DType::f32;  // index / boolean / fixed integer inputs; floats use the case's
  bool floating = true;      // takes the case's dtype (and Partial placements)
  bool absent = false;       // an undefined optional input
};

InputSpec in(Shape shape, double scale = 1.0);
InputSpec positive(Shape shape, double lo = 0.5, double hi = 2.5);
InputSpec away(Shape shape, double lo = 0.5, double hi = 2.0);
InputSpec integers(Shape shape, int64_t lo, int64_t hi);
InputSpec index(Shape shape, int64_t lo, int64_t hi, DType dtype = DType::i64);
InputSpec boolean(Shape shape);
InputSpec fixed_index(Shape shape, std::vector<double> values, DType dtype = DType::i64);
InputSpec absent();

using Tensors = std::vector<Tensor>;
using ShardedTensors = std::vector<ShardedTensor>;

// A factory's single-device and sharded forms (inputs are empty).
using FactorySingleFn = std::function<Tensor(const Attrs&)>;
using FactoryShardedFn =
    std::function<ShardedTensor(const Attrs&, const MeshPtr&, const Placements&)>;

struct OpCase {
  OpId op = OpId::neg;
  std::string label;
  std::vector<InputSpec> inputs;
  Attrs attrs;
  // Adjusts attrs to the case's dtype (factories' output dtype, cast targets).
  std::function<void(Attrs&, DType)> attrs_for;
  // Replaces inputs derived from others (layer_norm_backward's mean/rstd from x), on the
  // full single-device tensors, before anything is laid out.
  std::function<void(Tensors&, DType)> prepare;
  // Default: tessera::call (call_view for View ops) and parallel::call.
  std::function<Tensors(const Tensors&, const Attrs&)> single;
  std::function<ShardedTensors(const ShardedTensors&, const Attrs&)> sharded;
  // In-place ops: the inputs written (they share one Replicate/Shard placement, as the
  // rule must keep them); the written tensors are the outputs compared.
  std::vector<size_t> written;
  // In-place ops whose rule keeps the written inputs replicated (adamw8bit_: a block's scale
  // spans the block): only Replicate is tried for them (sharded_ops_test checks that a
  // sharded one is refused).
  bool written_replicated = false;
  // Factories: no inputs; every output placement is tried.
  FactorySingleFn factory_single;
  FactoryShardedFn factory_sharded;
  bool is_factory = false;
  // Extra mesh: {a: 2, b: 4} (8 ranks), for matmul.
  bool mesh_2x4 = false;
  // Also run in f32 (every case runs in f64).
  bool f32 = true;
};

OpCase op_case(OpId op, std::string label, std::vector<InputSpec> inputs, Attrs attrs = {});

// The whole table, in op-list order (sharded_cases.cc, sharded_cases_nn.cc).
std::vector<OpCase> sharded_cases();
std::vector<OpCase> elementwise_cases();  // the functor family ops (sharded_cases.cc)
// The composites, through their named forms (sharded_cases_nn.cc).
std::vector<OpCase> data_cases();
// The cases read from every op's record (tests/reference/cases.h; see sharded_cases.cc for
// which of a record's cases run here).
std::vector<OpCase> record_cases();

}  // namespace tessera::parallel::testing
