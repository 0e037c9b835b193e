// One record per op (after PyTorch's OpInfo and ggml's test_case): every op in
// tensor/op_list.h has one OpSweep, its cases (inputs with shapes and domains, attributes,
// the f64 reference of every output, tolerances) and its dtypes, in cases_<family>.cc.
// Every runner reads it:
//   - the op sweep (tests/tensor/op_sweep_test.cc; on cuda:0, tests/cuda): every case over
//     every dtype the op supports and every input layout, against the reference;
//   - gradcheck (tests/autograd/gradcheck_records.cc): the eligible cases in f64,
//     contiguous and permuted/strided;
//   - the sharded suite (tests/parallel/sharded_cases.cc, record_cases): the eligible
//     cases on every placement of every input.
// The functor family ops (tensor/op_list.h's TS_UNARY_OPS, ...) build theirs from their
// FunctorOpCase (op_cases.h). The few cases a runner cannot read from a record are written
// in that runner's files, which say why (dropout's one mask per gradcheck evaluation, the
// composites' and in-place ops' sharded forms).
//
//   OpSweep s{OpId::exp, kFloats, {DType::i32, DType::i64, DType::b8}};
//   s.cases.push_back(unary("[5, 7]", {5, 7}, uniform(-3, 3),
//                           [](double x) { return std::exp(x); }));
//
// Layouts: contiguous; permuted (a transpose for 2-D inputs, all dims reversed above);
// strided (every other element of the last dim, offset into a bigger buffer whose gaps
// hold NaN/sentinels); expanded (one dim broadcast from size 1 with stride 0). Values are
// drawn with tessera::randn/rand from a seed fixed per (op, case, input), mapped into the
// op's domain, and rounded to the input's dtype before the reference sees them.
//
// Tolerances (|got - want| <= bound per element), `mag` being the sum of the magnitudes of
// the terms the op adds or cancels (default |want|; e.g. sum(|x|) for sum, |a| @ |b| for
// matmul), because a floating evaluation's error is bounded by u * (terms) * mag:
//   f64:  rel64 * mag, rel64 = 1e-12: ~10^4 ulps, room for libm/Eigen transcendentals
//         (a few ulps) and sums of up to ~10^3 terms (n * 2^-53).
//   f32:  rel32 * mag, rel32 = 1e-5: ~170 ulps of 2^-24; covers recursive f32 sums of up
//         to ~160 terms per accumulator (n * u32) and a few-ulp transcendental; cases with
//         longer f32 accumulations set rel32 = n * 2^-24 from the kernel's accumulator length.
//   f16/bf16: the same op on the same values in f32 (the "twin"), because Tessera computes
//         16-bit floats in f32 and rounds the result: each rounding adds at most
//         u * |value| (u = 2^-11, 2^-8), so
//         |out16 - out32| <= rounds * u * (rounds > 1 ? mag : |out32|) + 2 * rel32 * mag
//         with rounds = 1 unless the kernel rounds partial results (index_add /
//         scatter_add accumulate in the 16-bit type).
//   Every bound also allows half the smallest subnormal of the output dtype per rounding
//   (2^-1075, 2^-25, 2^-134 for f64, f16, bf16): a result in the subnormal range (softmax
//   of far-apart logits) rounds to a multiple of it, whatever its relative error. f32
//   allows its smallest normal, 2^-126: its vectorised exp flushes subnormal results to 0.
//   exact ops (copies, views, indexing, comparisons, casts, max): bitwise equality.
//   Integer and bool outputs are always compared exactly.
//
// Devices: the sweep runs on sweep_device() (the CPU unless a suite sets another, as
// tests/cuda/cuda_op_sweep_test.cc sets cuda:0). Values are still drawn and laid out on the
// CPU; build() then copies the whole backing buffer (gaps and all) to the device and takes
// the same view of it, so the device kernel sees the same strides, offset and NaN-filled
// gaps. Outputs are read back through read_tensor(), which copies a device tensor's
// storage to the CPU first, and compared with the same reference and bounds (the bounds
// above are at least as strict as "CUDA f32 within 1e-5 relative of the CPU"). Where a
// device needs another bound, device_bounds() in cases_harness.cc states it per op with
// the reason. 16-bit twins run on the same device.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "tensor/op.h"
#include "tensor/ops.h"
#include "tests/reference/op_cases.h"
#include "tests/reference/reference.h"

namespace tessera::sweep {

using ref::NdArray;
using Arrays = std::vector<NdArray>;
using Tensors = std::vector<Tensor>;

enum class Layout : uint8_t { contiguous, permuted, strided, expanded };
inline constexpr Layout kLayouts[] = {Layout::contiguous, Layout::permuted, Layout::strided,
                                      Layout::expanded};
const char* layout_name(Layout layout);

inline const std::vector<DType> kFloats = {DType::f32, DType::f64, DType::f16, DType::bf16};
inline const std::vector<DType> kNumeric = {DType::f32,  DType::f64, DType::f16,
                                            DType::bf16, DType::i32, DType::i64};
inline const std::vector<DType> kAll = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                        DType::i32, DType::i64, DType::b8};
inline const std::vector<DType> kNonFloat = {DType::i32, DType::i64, DType::b8};

// How an input's values are drawn: the one vocabulary of every runner (op_cases.h), drawn
// by draw() below for all of them.
using ref::Domain;
using ref::normal;
using ref::uniform;
using ref::away;
using ref::ints;
using ref::nonzero_ints;
using ref::bools;
using ref::fixed;

struct Arg {
  Shape shape;
  Domain domain;
  std::optional<Domain> int_domain;  // used when the input's dtype is i32/i64/bool
  std::optional<DType> dtype;        // a fixed dtype (indices, conditions); else the case's
  bool stats = false;      // dtype is the stats dtype of the case's (f64 -> f64, else f32)
  bool absent = false;     // an undefined optional input
  bool expandable = true;  // false for an input written in place (an output of copy_, adamw_, sgd_)
};
Arg arg(Shape shape, Domain domain = normal(), std::optional<Domain> int_domain = std::nullopt);
Arg index_arg(Shape shape, int64_t lo, int64_t hi, DType dt = DType::i64);
Arg fixed_arg(Shape shape, std::vector<double> values, DType dt);
// `a` as an input the op writes in place: never laid out as an expanded (stride-0) view,
// whose elements sharing one location could not each be updated.
inline Arg written(Arg a) {
  a.expandable = false;
  return a;
}
Arg absent_arg();

struct Case {
  std::string label;
  std::vector<Arg> args;
  Attrs attrs;
  // All outputs from the inputs' values (as the tensors hold them) and the case's dtype.
  std::function<Arrays(const Arrays&, DType)> ref;
  // Per output: the magnitude the error is relative to (see the header); missing: |want|.
  std::function<Arrays(const Arrays&, DType)> mag;
  // Runs the op in dtype dt (default: call(op, inputs, attrs), call_view for view ops,
  // call_inplace / call_copy_ for in-place ops (their outputs: the written inputs), with
  // attrs.dtype = dt for factories and attrs.device the sweep's device for factories and
  // to_device); all outputs. Only for a case that tests a named form beyond the op (the
  // other runners then read only the cases without it).
  std::function<Tensors(const Tensors&, DType)> run;
  // Derives inputs from others (e.g. mean/rstd for layer_norm_backward), on rounded values.
  std::function<void(Arrays&, DType)> prepare;
  // Output dtype from the case dtype (default: the case dtype).
  std::function<DType(DType, size_t)> out_dtype;
  double rel32 = 1e-5, rel64 = 1e-12;
  double rounds = 1;          // 16-bit roundings that reach one output element
  bool exact = false;         // bitwise equality for every dtype
  bool views_input0 = false;   // outputs must share input 0's storage (view ops)
  bool copies_input0 = false;  // outputs must be contiguous copies (clone, to_device)
  std::vector<DType> dtypes;  // restricts the op's dtypes for this case
  std::vector<Layout> layouts = {kLayouts, kLayouts + 4};
  // What the other runners read besides the above (see the top of this file):
  int grad_output = 0;  // the output gradcheck differentiates
  bool grad = true;     // gradcheck it (when eligible: see gradcheck_records.cc)
  bool sharded = true;  // run it on every placement (when eligible: see sharded_cases.cc)
};

struct OpSweep {
  OpId op;
  std::vector<DType> dtypes;    // each supported dtype runs every case
  std::vector<DType> rejected;  // dtypes that must throw tessera::Error (first case's inputs)
  std::vector<Case> cases;
  std::function<void()> extra;  // checks outside the table (errors, randomness, aliasing)
};

// Every op's record, in op-list order within each family file.
const std::vector<OpSweep>& all_sweeps();
std::vector<OpSweep> elementwise_sweeps();  // cases_elementwise.cc
std::vector<OpSweep> nn_sweeps();           // cases_nn.cc
std::vector<OpSweep> attention_sweeps();    // cases_attention.cc (part of nn_sweeps)
std::vector<OpSweep> linear_sweeps();       // cases_linear.cc (part of nn_sweeps)
std::vector<OpSweep> norm_sweeps();         // cases_norm.cc (part of nn_sweeps)
std::vector<OpSweep> optim_pass_sweeps();   // cases_optim_passes.cc (part of optim_sweeps)
std::vector<OpSweep> data_sweeps();         // cases_data.cc
std::vector<OpSweep> optim_sweeps();        // cases_optim.cc

// ---- harness (cases_harness.cc) ------------------------------------------------------
// A contiguous tensor holding `a` (values must be representable in dt), written directly
// into memory: no Tessera kernel takes part.
Tensor make_tensor(const NdArray& a, DType dt);
// The logical values of any (strided) tensor, read directly from memory (a device tensor's
// storage is copied to the CPU first).
NdArray read_tensor(const Tensor& t);
// The value stored at flat storage position `i` of t's storage (for gap checks).
double read_storage(const Tensor& t, int64_t i);
// An in-place op's effects on strided f32 [3, 4] inputs: `update` bumps the version of the
// inputs it writes (their indices: written_inputs) and of no other, and leaves the storage
// gaps between their elements alone.
void inplace_effects(const std::function<void(const Tensors&)>& update, size_t n_inputs,
                     std::vector<size_t> written_inputs, const char* op);
// Values for `arg` drawn from a generator seeded with `seed`, rounded to dt.
NdArray draw(const Arg& arg, DType dt, uint64_t seed);

struct Built {
  Tensor tensor;
  NdArray seen;           // the values the tensor holds (expanded layouts repeat a slice)
  bool laid_out = false;  // the layout changed something
};
// `values` laid out as `layout` (see the header) in dtype dt, on sweep_device().
Built build(const NdArray& values, DType dt, Layout layout, size_t arg_index,
            bool expandable = true);

// Per op: table runs (one op x case x dtype x layout, or one rejected dtype, or the
// extra checks) that passed and failed, and the first failure's message.
struct OpTally {
  int64_t passed = 0, failed = 0;
  std::string first_failure;
};

struct Coverage {
  std::set<std::tuple<int, int, int>> combos;  // (op, dtype, layout) that ran
  int64_t runs = 0, outputs_checked = 0, rejections_checked = 0;
  std::map<OpId, OpTally> per_op;
  // Failure messages printed per op (the rest are counted in per_op only); -1: all. A
  // device suite sets a few, so one missing kernel does not print thousands of lines.
  int64_t print_limit_per_op = -1;
};

// The device the sweep's tensors live on (kCPU by default).
Device sweep_device();
void set_sweep_device(Device device);
// `t` (contiguous, on the CPU) on sweep_device(); t itself when that is the CPU.
Tensor on_sweep_device(const Tensor& t);

void run_sweep(const OpSweep& sweep, Coverage& coverage);
// Case ci's input values in dtype dt (drawn from the case's domains with a seed fixed per
// op, case and input, then `prepare`d), as every runner draws them.
Arrays draw_inputs(const OpSweep& sweep, const Case& c, size_t ci, DType dt);
// Runs case c on `inputs` in dtype dt: c.run, or call(op, inputs, attrs).
Tensors run_case(const OpSweep& sweep, const Case& c, const Tensors& inputs, DType dt);
// Whether case c runs in dtype dt: the op supports it and the case does not restrict it away.
bool runs_in(const OpSweep& sweep, const Case& c, DType dt);
// The dtype an input of case dtype dt takes (its fixed dtype, the stats dtype, or dt).
DType arg_dtype(const Arg& a, DType dt);
// An in-place op's written inputs (copy_, adamw_, sgd_): the case's present inputs with
// Arg::expandable false, in order; empty for any other op.
std::vector<size_t> written_inputs(const OpSweep& sweep, const Case& c);
// Reports a failure (doctest FAIL_CHECK, within Coverage::print_limit_per_op) and counts it
// against the op being swept.
void report_failure(const std::string& message);

// For extra checks: compare with a message naming `what`; bound = rel * mag + abs (mag
// defaults to |want|). Returns whether it passed (failures are reported).
bool expect_close(const std::string& what, const Tensor& got, const NdArray& want, double rel,
                  double abs = 0.0, const NdArray* mag = nullptr);
// For extra checks against another computation of the same bits (a fused op against the ops
// it replaces): got and want (any device) must have one shape and dtype and equal bytes;
// a failure names `what` and the first differing element. Returns whether it passed.
bool expect_same_bits(const std::string& what, const Tensor& got, const Tensor& want);
// Runs f and checks that it throws tessera::Error.
void expect_error(const std::string& what, const std::function<void()>& f);

// |a| elementwise (the usual error magnitude of a case's terms).
NdArray abs_of(const NdArray& a);

// The error magnitude of an f32 GELU value at x and of its derivative times g (either form),
// as the rel32 bound multiplies it (cases_elementwise.cc).
double gelu_mag(double x, bool tanh_form);
double gelu_backward_mag(double g, double x, bool tanh_form);

// Case builders shared by the family files.
Case unary(std::string label, Shape shape, Domain domain, std::function<double(double)> f,
           std::optional<Domain> int_domain = std::nullopt);

}  // namespace tessera::sweep
