// The case table of the sharded op equivalence test (sharded_ops_test.cc): per op in
// tensor/op_list.h, inputs (shapes and value domains), attributes, and how the op runs on
// one device and on sharded tensors. The harness tries every placement of every input on
// several meshes and compares with the single-device result.
//
//   OpCase c = op_case(OpId::add, "[5, 7] + [5, 7]", {in({5, 7}), in({5, 7})});
//   c.attrs.dim = 1;                   // Attrs as tensor/op.h documents them per op
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

namespace tessera::parallel::testing {

// How an input's values are drawn.
enum class Domain : uint8_t {
  normal,     // N(0, scale^2)
  positive,   // uniform [lo, hi), lo > 0
  away,       // a random sign times uniform [lo, hi)
  integers,   // integer values in [lo, hi] in the case's float dtype (ties for comparisons)
  index,      // integer values in [lo, hi] in an integer dtype
  boolean,    // b8
  fixed,      // `values`, in `dtype` (or the case dtype when floating)
};

struct InputSpec {
  Shape shape;
  Domain domain = Domain::normal;
  double lo = 0.0, hi = 1.0;  // normal: hi is the scale
  DType dtype = DType::f32;   // index / boolean / fixed integer inputs; floats use the case's
  bool floating = true;       // takes the case's dtype (and Partial placements)
  bool absent = false;        // an undefined optional input
  std::vector<double> values; // fixed
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
std::vector<OpCase> elementwise_cases();  // sharded_cases.cc
std::vector<OpCase> nn_cases();           // sharded_cases_nn.cc
std::vector<OpCase> data_cases();         // sharded_cases_nn.cc
std::vector<OpCase> test_case_cases();    // the cases of tests/reference/op_cases.cc

}  // namespace tessera::parallel::testing
