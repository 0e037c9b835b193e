// GPU-tagged: the fused optimizer updates (adamw_, adamw8bit_, sgd_) on CUDA, single- and
// multi-tensor forms, and optim::AdamW / optim::SGD stepping CUDA parameters, against the
// CPU kernels (the spec). Needs a GPU and --config=cuda:
//   bazel test --config=cuda --test_tag_filters=gpu //tests/cuda:optim_test
//
// Tolerances: the CUDA kernels do the CPU's operations in the CPU's order, but either
// compiler may fuse a multiply and an add (FMA), so results may differ by an ulp or two of
// the operands: f32 |got - want| <= 1e-6 (|want| + max|want|), f64 the same with 1e-12; a
// bf16 param within one bf16 ulp (2^-7 relative) of the CPU's and exactly its own master
// rounded. The max|want| term covers cancellation in exp_avg += (1 - b1) (g - exp_avg).
// adamw8bit_ has no tolerance: its kernel forbids the FMA, so it equals the CPU bitwise.
//
// The multi-tensor form against one call per tensor, its shape errors and AdamW's retry
// param by param need no GPU: tests/optim/multi_tensor_test.cc.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "optim/adafactor.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/sgd.h"
#include "tensor/grad_mode.h"
#include "tensor/op.h"
#include "tensor/ops.h"
#include "tests/optim/multi_tensor_util.h"

using namespace tessera;

namespace {

using optim::testing::call_tuples;
using optim::testing::make_operands;
using optim::testing::Operands;
using optim::testing::Views;
using optim::testing::views_into;

// |got - want| <= rel * (|want| + scaled * max|want|) everywhere, failing once with the
// worst element.
void check_close(const Tensor& got, const Tensor& want, double rel, const std::string& what,
                 double scaled = 1.0) {
  REQUIRE(got.shape() == want.shape());
  const std::vector<double> g = got.to(kCPU).to_vector<double>();
  const std::vector<double> w = want.to(kCPU).to_vector<double>();
  double scale = 0;
  for (double x : w) scale = std::max(scale, std::fabs(x));
  scale *= scaled;
  size_t bad = 0, worst = 0;
  double worst_excess = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double diff = std::fabs(g[i] - w[i]);
    const double bound = rel * (std::fabs(w[i]) + scale);
    if (!(diff <= bound)) {
      ++bad;
      const double excess = std::isnan(diff) ? INFINITY : diff / bound;
      if (excess >= worst_excess) worst_excess = excess, worst = i;
    }
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", g.size(), " elements off; worst [", worst,
                "] got ", g.empty() ? 0 : g[worst], " want ", w.empty() ? 0 : w[worst]);
}

DType state_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }
double rel_for(DType dt) { return dt == DType::f64 ? 1e-12 : 1e-6; }

Operands to_cuda(const Operands& cpu, const std::vector<int64_t>& sizes) {
  Operands o;
  for (const Views& v : cpu.roles) o.roles.push_back(views_into(v.flat.to(cuda(0)), sizes));
  return o;
}

// ---- adamw_ --------------------------------------------------------------------------------

void adamw_against_cpu(DType dt, bool master, double weight_decay,
                       const std::vector<int64_t>& sizes) {
  CAPTURE(dt);
  CAPTURE(master);
  CAPTURE(weight_decay);
  const DType st = state_dtype(dt);
  std::vector<DType> roles = {dt, dt, st, st};
  if (master) roles.push_back(DType::f32);
  Operands cpu = make_operands(sizes, roles, 7);
  cpu.roles[3].flat = abs(cpu.roles[3].flat);  // exp_avg_sq >= 0
  cpu.roles[3] = views_into(cpu.roles[3].flat, sizes);
  if (master) {  // the master holds the param's value, the param its rounding
    cpu.roles[4].flat.copy_(cast(cast(cpu.roles[4].flat, dt), DType::f32));
    cpu.roles[0].flat.copy_(cast(cpu.roles[4].flat, dt));
  }
  Operands gpu = to_cuda(cpu, sizes);
  const size_t k = sizes.size();
  for (int64_t step = 1; step <= 3; ++step) {
    Attrs a;
    a.step_count = step;
    a.lr = 1e-2;
    a.beta1 = 0.9;
    a.beta2 = 0.99;
    a.eps = 1e-8;
    a.weight_decay = weight_decay;
    Generator gen(100 + step);
    for (size_t j = 0; j < k; ++j) {  // fresh gradients each step, same on both devices
      Tensor g = cast(randn({sizes[j]}, DType::f32, kCPU, &gen), dt);
      cpu.at(1, j).copy_(g);
      gpu.at(1, j).copy_(g);
    }
    for (Operands* o : {&cpu, &gpu}) {
      std::vector<Tensor> in;
      for (size_t j = 0; j < k; ++j) {
        in.insert(in.end(), {o->at(0, j), o->at(1, j), o->at(2, j), o->at(3, j),
                             master ? o->at(4, j) : Tensor()});
      }
      call_tuples(OpId::adamw_, std::move(in), a, 5, {0, 2, 3, 4});
    }
  }
  const double rel = rel_for(dt);
  for (size_t j = 0; j < k; ++j) {
    const std::string at = "tensor " + std::to_string(j) + " of " + std::to_string(sizes[j]);
    check_close(gpu.at(2, j), cpu.at(2, j), rel, "exp_avg " + at);
    check_close(gpu.at(3, j), cpu.at(3, j), rel, "exp_avg_sq " + at);
    if (dt == DType::f32 || dt == DType::f64) {
      check_close(gpu.at(0, j), cpu.at(0, j), rel, "param " + at);
    } else {
      check_close(gpu.at(0, j), cpu.at(0, j), 1.0 / 128, "16-bit param " + at, 0.0);
    }
    if (master) {
      check_close(gpu.at(4, j), cpu.at(4, j), rel, "master " + at);
      const Tensor rounded = cast(gpu.at(4, j), dt).to(kCPU);
      CHECK_MESSAGE(rounded.to_vector<float>() == gpu.at(0, j).to(kCPU).to_vector<float>(),
                    "param is not its master rounded, ", at);
    }
  }
}

const std::vector<int64_t> kOddSizes = {1, 3, 1000003, 4096, 17, 2 * 16384 + 5, 4, 0, 16384};

TEST_CASE("adamw_ multi-tensor on CUDA matches the CPU: f32, f64, decay on and off") {
  for (DType dt : {DType::f32, DType::f64}) {
    for (double wd : {0.0, 0.1}) adamw_against_cpu(dt, false, wd, kOddSizes);
  }
}

TEST_CASE("adamw_ on CUDA: bf16 and f16 params with f32 master weights, and without") {
  adamw_against_cpu(DType::bf16, true, 0.1, kOddSizes);
  adamw_against_cpu(DType::f16, true, 0.0, {5, 1000, 33});
  adamw_against_cpu(DType::bf16, false, 0.1, {5, 1000, 33});
}

TEST_CASE("adamw_ single-tensor form on CUDA matches the CPU") {
  adamw_against_cpu(DType::f32, false, 0.05, {1000});
}

TEST_CASE("adamw_ on CUDA: lists longer than one launch (tensor slots and block table)") {
  // 200 tensors (a launch takes at most 90 with 4 operands), one of them 4M + 5 elements.
  std::vector<int64_t> sizes;
  for (int64_t j = 0; j < 200; ++j) sizes.push_back(j * 977 % 5003 + 1);
  sizes.insert(sizes.begin() + 50, (int64_t(1) << 22) + 5);
  adamw_against_cpu(DType::f32, false, 0.1, sizes);
}

TEST_CASE("adamw_ on CUDA with non-contiguous operands (packed and written back)") {
  Generator gen(3);
  auto rnd = [&](Shape s) { return randn(s, DType::f32, kCPU, &gen); };
  // param and exp_avg transposed views, grad a strided slice, exp_avg_sq contiguous.
  Tensor p = rnd({5, 7}), m = rnd({5, 7}), v = abs(rnd({7, 5})), g = rnd({7, 10});
  Tensor pd = p.to(cuda(0)), md = m.to(cuda(0)), vd = v.to(cuda(0)), gd = g.to(cuda(0));
  Tensor other = rnd({64}), otherd = other.to(cuda(0));
  Tensor og = rnd({64}), ogd = og.to(cuda(0));
  Tensor om = zeros({64}), omd = om.to(cuda(0)), ov = zeros({64}), ovd = ov.to(cuda(0));
  Attrs a;
  a.step_count = 4;
  a.lr = 1e-3;
  a.weight_decay = 0.01;
  call_tuples(OpId::adamw_, {p.permute({1, 0}), g.slice(1, 0, 10, 2), m.permute({1, 0}), v,
                             Tensor(), other, og, om, ov, Tensor()},
              a, 5, {0, 2, 3, 4});
  call_tuples(OpId::adamw_, {pd.permute({1, 0}), gd.slice(1, 0, 10, 2), md.permute({1, 0}), vd,
                             Tensor(), otherd, ogd, omd, ovd, Tensor()},
              a, 5, {0, 2, 3, 4});
  check_close(pd, p, 1e-6, "transposed param");
  check_close(md, m, 1e-6, "transposed exp_avg");
  check_close(vd, v, 1e-6, "exp_avg_sq");
  check_close(otherd, other, 1e-6, "second tuple's param");
}

TEST_CASE("adamw_ on CUDA: an overlap in one tuple names it and writes nothing") {
  Tensor p = ones({8}, DType::f32, cuda(0)), g = ones({8}, DType::f32, cuda(0));
  Tensor q = ones({8}, DType::f32, cuda(0)), v = zeros({8}, DType::f32, cuda(0));
  Attrs a;
  a.lr = 0.1;
  try {
    call_tuples(OpId::adamw_, {p, g, zeros({8}, DType::f32, cuda(0)), zeros_like(v), Tensor(),
                               q, g, q, v, Tensor()},
                a, 5, {0, 2, 3, 4});
    FAIL("no error");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("tuple 1 of 2") != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("overlap") != std::string::npos, msg);
  }
  CHECK(p.to(kCPU).to_vector<float>() == std::vector<float>(8, 1.0f));
}

// ---- adamw8bit_ ----------------------------------------------------------------------------
// Bitwise: optim.cu's kernel rounds every operation once, in the CPU kernel's order (both
// without FMA contraction), and the block maxima and codes are exact functions of the
// rounded values, so param, master, codes and scales must equal the CPU's bit for bit.

// One adamw8bit_ call on consecutive tuples of `width` (6 or 7) inputs, every operand but
// grad written (call_tuples' fixed table holds too few indices for the longest list here).
void call_adam8(std::vector<Tensor> in, const Attrs& a, size_t width) {
  std::vector<size_t> written;
  for (size_t j = 0; j < in.size() / width; ++j) {
    for (size_t k : {0, 2, 3, 4, 5, 6}) {
      if (k < width) written.push_back(j * width + k);
    }
  }
  NoGradGuard no_grad;
  call_inplace(OpId::adamw8bit_, std::move(in), a, written);
}

// One tuple: param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, master.
// grad_base: the storage grad views (grad itself may be a transposed view of it).
struct Adam8Tuple {
  std::array<Tensor, 7> t;
  Tensor grad_base;
};

Adam8Tuple adam8_on(const Adam8Tuple& x, Device d) {
  Adam8Tuple y;
  for (size_t i = 0; i < 7; ++i) {
    if (i != 1 && x.t[i].defined()) y.t[i] = x.t[i].to(d);
  }
  y.grad_base = x.grad_base.to(d);
  y.t[1] = x.t[1].is_contiguous() ? y.grad_base : y.grad_base.t();
  return y;
}

// Random codes and scales (a moment of any size), or the all-zero state when `zero`.
Adam8Tuple make_adam8(const Shape& shape, DType dt, bool master, bool zero, uint64_t seed) {
  const DType st = state_dtype(dt);
  Generator gen(seed);
  std::mt19937 bytes(static_cast<uint32_t>(seed));
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const int64_t blocks = (n + 255) / 256;
  auto codes = [&](uint8_t fill) {
    std::vector<uint8_t> c(static_cast<size_t>(n), fill);
    if (!zero) {
      for (uint8_t& x : c) x = static_cast<uint8_t>(bytes() & 0xff);
    }
    return Tensor::from_vector(c, shape);
  };
  Adam8Tuple x;
  x.t[0] = cast(randn(shape, DType::f64, kCPU, &gen), dt);
  x.t[2] = codes(127);  // 127, 0: the zero codes of the signed and the unsigned map
  x.t[3] = codes(0);
  x.t[4] = zero ? zeros({blocks}, st)
                : cast(abs(randn({blocks}, DType::f64, kCPU, &gen)) * 0.1, st);
  x.t[5] = zero ? zeros({blocks}, st)
                : cast(abs(randn({blocks}, DType::f64, kCPU, &gen)) * 0.01, st);
  if (master) {  // the master holds the param's value, the param its rounding
    // clone(): cast to its own dtype returns the same tensor, and an f32 param's master must
    // be a buffer of its own.
    x.t[6] = cast(x.t[0], DType::f32).clone();
    x.t[0] = cast(x.t[6], dt).clone();
  }
  // A 2-D param gets a transposed (non-contiguous) grad: packed by the CUDA glue.
  if (shape.size() == 2) {
    x.grad_base = zeros({shape[1], shape[0]}, dt);
    x.t[1] = x.grad_base.t();
  } else {
    x.grad_base = zeros(shape, dt);
    x.t[1] = x.grad_base;
  }
  return x;
}

// got == want bit for bit (through f64, exact for every dtype here), failing once with the
// first differing element.
void check_same_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  REQUIRE(got.dtype() == want.dtype());
  REQUIRE(got.shape() == want.shape());
  const std::vector<double> g = cast(got.to(kCPU), DType::f64).to_vector<double>();
  const std::vector<double> w = cast(want, DType::f64).to_vector<double>();
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const bool same = std::isnan(w[i]) ? std::isnan(g[i])
                                       : g[i] == w[i] && std::signbit(g[i]) == std::signbit(w[i]);
    if (!same && bad++ == 0) first = i;
  }
  CHECK_MESSAGE(bad == 0, what, ": ", bad, " of ", g.size(), " elements differ; first [", first,
                "] got ", bad ? g[first] : 0.0, " want ", bad ? w[first] : 0.0);
}

// Three steps of adamw8bit_ over tensors of `shapes` (one call each step, multi-tensor form
// unless `single`), the same on the CPU and on cuda:0. Tensor `zero_at` starts from the
// all-zero state and gets zero gradients (its blocks' scales stay 0: the x / 0 rule).
void adamw8bit_against_cpu(DType dt, bool master, double weight_decay,
                           const std::vector<Shape>& shapes, bool single = false,
                           size_t zero_at = SIZE_MAX) {
  CAPTURE(dt);
  CAPTURE(master);
  CAPTURE(weight_decay);
  std::vector<Adam8Tuple> cpu, gpu;
  for (size_t j = 0; j < shapes.size(); ++j) {
    cpu.push_back(make_adam8(shapes[j], dt, master, j == zero_at, 40 + j));
    gpu.push_back(adam8_on(cpu.back(), cuda(0)));
  }
  for (int64_t step = 1; step <= 3; ++step) {
    Attrs a;
    a.step_count = step;
    a.lr = 1e-2;
    a.beta1 = 0.9;
    a.beta2 = 0.99;
    a.eps = 1e-8;
    a.weight_decay = weight_decay;
    Generator gen(500 + step);
    for (size_t j = 0; j < shapes.size(); ++j) {  // fresh gradients, same on both devices
      const Shape& s = cpu[j].grad_base.shape();
      Tensor g = j == zero_at ? zeros(s, dt) : cast(randn(s, DType::f32, kCPU, &gen), dt);
      cpu[j].grad_base.copy_(g);
      gpu[j].grad_base.copy_(g);
    }
    for (std::vector<Adam8Tuple>* side : {&cpu, &gpu}) {
      std::vector<Tensor> in;
      for (const Adam8Tuple& x : *side) {
        in.insert(in.end(), x.t.begin(), single && !master ? x.t.end() - 1 : x.t.end());
      }
      call_adam8(std::move(in), a, single && !master ? 6 : 7);
    }
  }
  static constexpr const char* kRoles[] = {"param",          "grad",
                                           "exp_avg",        "exp_avg_sq",
                                           "exp_avg_absmax", "exp_avg_sq_absmax",
                                           "master"};
  for (size_t j = 0; j < shapes.size(); ++j) {
    const std::string at = "tensor " + std::to_string(j) + " " + shape_str(shapes[j]);
    for (size_t i : {0, 2, 3, 4, 5, 6}) {
      if (cpu[j].t[i].defined()) check_same_bits(gpu[j].t[i], cpu[j].t[i], kRoles[i] + (" " + at));
    }
    // The update did something: the scales moved off their start (bar the all-zero state).
    if (j != zero_at && cpu[j].t[0].numel() > 0) {
      CHECK(cpu[j].t[4].to_vector<double>() !=
            make_adam8(shapes[j], dt, master, false, 40 + j).t[4].to_vector<double>());
    }
  }
}

// A single element, a partial block, one block exactly, one past it, a partial last block
// after several, a whole chunk of 8 blocks, several chunks with a partial last block, an
// empty tensor, and a 2-D param with a transposed grad.
const std::vector<Shape> kAdam8Shapes = {{1},    {255},           {256}, {257},    {1000},
                                         {2048}, {5 * 2048 + 300}, {0},   {37, 20}, {4097}};

TEST_CASE("adamw8bit_ multi-tensor on CUDA equals the CPU bitwise: f32 and f64, decay on/off") {
  for (DType dt : {DType::f32, DType::f64}) {
    adamw8bit_against_cpu(dt, false, 0.1, kAdam8Shapes, false, 4);
    adamw8bit_against_cpu(dt, false, 0.0, {{513}, {300}});
  }
}

TEST_CASE("adamw8bit_ on CUDA equals the CPU bitwise with f32 masters: f32, f16, bf16") {
  adamw8bit_against_cpu(DType::f32, true, 0.1, kAdam8Shapes, false, 2);
  adamw8bit_against_cpu(DType::f16, true, 0.0, kAdam8Shapes);
  adamw8bit_against_cpu(DType::bf16, true, 0.1, kAdam8Shapes, false, 0);
}

TEST_CASE("adamw8bit_ single-tensor form on CUDA equals the CPU bitwise") {
  adamw8bit_against_cpu(DType::f32, false, 0.05, {{1000}}, true);
  adamw8bit_against_cpu(DType::bf16, true, 0.05, {{777}}, true);
}

TEST_CASE("adamw8bit_ on CUDA: lists longer than one launch") {
  // 250 tensors (a launch takes at most 203 with 6 operands).
  std::vector<Shape> shapes;
  for (int64_t j = 0; j < 250; ++j) shapes.push_back({j * 389 % 3001 + 1});
  adamw8bit_against_cpu(DType::f32, false, 0.1, shapes);
}

TEST_CASE("adamw8bit_ on CUDA: a non-contiguous code tensor is an error naming the tuple") {
  const Tensor p = zeros({4, 4}, DType::f32, cuda(0)), g = zeros({4, 4}, DType::f32, cuda(0));
  const Tensor c1 = zeros({4, 4}, DType::u8, cuda(0)), c2 = zeros({4, 4}, DType::u8, cuda(0));
  const Tensor a1 = zeros({1}, DType::f32, cuda(0)), a2 = zeros({1}, DType::f32, cuda(0));
  const Tensor q = ones({8}, DType::f32, cuda(0)), qg = ones({8}, DType::f32, cuda(0));
  const Tensor qc1 = zeros({8}, DType::u8, cuda(0)), qc2 = zeros({8}, DType::u8, cuda(0));
  const Tensor qa1 = zeros({1}, DType::f32, cuda(0)), qa2 = zeros({1}, DType::f32, cuda(0));
  Attrs a;
  a.lr = 0.1;
  try {
    call_adam8({q, qg, qc1, qc2, qa1, qa2, Tensor(), p, g, c1.t(), c2, a1, a2, Tensor()}, a, 7);
    FAIL("no error");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.find("tuple 1 of 2") != std::string::npos, msg);
    CHECK_MESSAGE(msg.find("exp_avg [4, 4] must be contiguous") != std::string::npos, msg);
  }
  CHECK(q.to(kCPU).to_vector<float>() == std::vector<float>(8, 1.0f));  // nothing written
}

// ---- adamw8bit_segments_ (no CUDA kernel: the CPU kernel on staged copies) ----------------

// One pass-1 call on `d`: param and master views of one flat f32 buffer (so one storage holds
// both, as ZeRO's flat buffers do), or master aliasing param when `alias`.
std::vector<Tensor> segments_pass1(Device d, bool alias) {
  Generator gen(23);
  const Tensor flat = randn({1024}, DType::f32, kCPU, &gen).to(d);
  const Tensor param = flat.narrow(0, 0, 512), master = alias ? param : flat.narrow(0, 512, 512);
  if (!alias) master.copy_(param);
  const Tensor grad = randn({512}, DType::f32, kCPU, &gen).to(d);
  const Tensor c1 = full({512}, 127.0, DType::u8, d), c2 = zeros({512}, DType::u8, d);
  const Tensor a1 = full({2}, 0.1, DType::f32, d), a2 = full({2}, 0.01, DType::f32, d);
  const Tensor segments = Tensor::from_vector<int64_t>({256, 0, 512, 1}, {2, 2}).to(d);
  const Tensor n1 = zeros({2}, DType::f32, d), n2 = zeros({2}, DType::f32, d);
  NoGradGuard no_grad;
  adamw8bit_segments_(param, grad, c1, c2, a1, a2, master, segments, n1, n2, 1, 1, 1e-2, 0.9,
                      0.999, 1e-8, 0.1);
  return {flat, n1, n2};
}

TEST_CASE("adamw8bit_segments_ on CUDA: views of one storage staged as one; aliasing refused") {
  const std::vector<Tensor> cpu = segments_pass1(kCPU, false), gpu = segments_pass1(cuda(0), false);
  for (size_t i = 0; i < cpu.size(); ++i) check_same_bits(gpu[i], cpu[i], "output " + std::to_string(i));
  // The CPU kernel sees the device's aliasing: master and param in one buffer.
  for (Device d : {kCPU, cuda(0)}) {
    CAPTURE(d);
    CHECK_THROWS_WITH(segments_pass1(d, true), doctest::Contains("overlap"));
  }
}

// ---- sgd_ ----------------------------------------------------------------------------------

void sgd_against_cpu(DType dt, bool master, double momentum, double dampening, bool nesterov,
                     double weight_decay) {
  CAPTURE(dt);
  CAPTURE(master);
  CAPTURE(momentum);
  CAPTURE(nesterov);
  CAPTURE(weight_decay);
  const std::vector<int64_t> sizes = {1, 3, 1000003, 17, 65536 + 1};
  const bool buffer = momentum != 0.0;
  Operands cpu = make_operands(sizes, {dt, dt, state_dtype(dt), DType::f32}, 11);
  if (master) {
    cpu.roles[3].flat.copy_(cast(cast(cpu.roles[3].flat, dt), DType::f32));
    cpu.roles[0].flat.copy_(cast(cpu.roles[3].flat, dt));
  }
  Operands gpu = to_cuda(cpu, sizes);
  for (int64_t step = 1; step <= 3; ++step) {
    Attrs a;
    a.step_count = step;
    a.lr = 0.05;
    a.momentum = momentum;
    a.dampening = dampening;
    a.nesterov = nesterov;
    a.weight_decay = weight_decay;
    Generator gen(200 + step);
    for (size_t j = 0; j < sizes.size(); ++j) {
      Tensor g = cast(randn({sizes[j]}, DType::f32, kCPU, &gen), dt);
      cpu.at(1, j).copy_(g);
      gpu.at(1, j).copy_(g);
    }
    for (Operands* o : {&cpu, &gpu}) {
      std::vector<Tensor> in;
      for (size_t j = 0; j < sizes.size(); ++j) {
        in.insert(in.end(), {o->at(0, j), o->at(1, j), buffer ? o->at(2, j) : Tensor(),
                             master ? o->at(3, j) : Tensor()});
      }
      call_tuples(OpId::sgd_, std::move(in), a, 4, {0, 2, 3});
    }
  }
  const double rel = rel_for(dt);
  for (size_t j = 0; j < sizes.size(); ++j) {
    const std::string at = "tensor " + std::to_string(j);
    if (buffer) check_close(gpu.at(2, j), cpu.at(2, j), rel, "momentum_buffer " + at);
    if (master) check_close(gpu.at(3, j), cpu.at(3, j), rel, "master " + at);
    if (dt == DType::f32 || dt == DType::f64) {
      check_close(gpu.at(0, j), cpu.at(0, j), rel, "param " + at);
    } else {
      // Its master's rounding: one bf16 ulp, plus the master's own bound (rel x max|master|),
      // which covers an update that cancels the value (0 on one device, 1e-9 on the other).
      check_close(gpu.at(0, j), cpu.at(0, j), 1.0 / 128, "16-bit param " + at, 128 * rel);
    }
  }
}

TEST_CASE("sgd_ multi-tensor on CUDA matches the CPU: plain, momentum, dampening, nesterov") {
  for (DType dt : {DType::f32, DType::f64}) {
    sgd_against_cpu(dt, false, 0.0, 0.0, false, 0.0);
    sgd_against_cpu(dt, false, 0.0, 0.0, false, 1e-2);
    sgd_against_cpu(dt, false, 0.9, 0.1, false, 1e-2);
    sgd_against_cpu(dt, false, 0.9, 0.0, true, 0.0);
  }
  sgd_against_cpu(DType::bf16, true, 0.9, 0.0, true, 1e-2);
  sgd_against_cpu(DType::bf16, true, 0.0, 0.0, false, 0.0);
}

// ---- optim::AdamW / optim::SGD -------------------------------------------------------------

// A small model's worth of params: matrices (decayed) and vectors (not), f32 and bf16.
std::vector<Tensor> make_params(Device d) {
  Generator gen(5);
  std::vector<Tensor> ps;
  for (Shape s : {Shape{64, 33}, Shape{33}, Shape{1}, Shape{129, 7}, Shape{1000}}) {
    ps.push_back(randn(s, DType::f32, kCPU, &gen).to(d).requires_grad_());
  }
  ps.push_back(cast(randn({17, 5}, DType::f32, kCPU, &gen), DType::bf16).to(d).requires_grad_());
  ps.push_back(cast(randn({3}, DType::f32, kCPU, &gen), DType::bf16).to(d).requires_grad_());
  return ps;
}

// Adafactor's and AdamW8bit's, all of dtype `dt`: factored over the last two dims (hf, torch:
// every matrix; optax: only where the second-largest dim is >= 128, as {130, 140}), a 3-D
// stack, and kept whole (vectors).
std::vector<Tensor> make_factored_params(Device d, DType dt) {
  Generator gen(5);
  std::vector<Tensor> ps;
  for (Shape s : {Shape{64, 33}, Shape{33}, Shape{130, 140}, Shape{2, 40, 24}, Shape{1}}) {
    ps.push_back(cast(randn(s, DType::f32, kCPU, &gen), dt).to(d).requires_grad_());
  }
  return ps;
}

// The bounds of one param and its state (check_close: rel x (|want| + scaled x max|want|));
// 0: bitwise.
struct Tol {
  double param, scaled, state;
};
// adamw_'s and sgd_'s: f32/f64 within rel_for(dt); a 16-bit param within one bf16 ulp of the
// CPU's plus its master's bound (an update may cancel the value: 0 on one device, 1e-9 on
// the other).
Tol fused_tol(DType dt) {
  if (dt == DType::f32 || dt == DType::f64) return {rel_for(dt), 1.0, rel_for(dt)};
  return {1.0 / 128, 128 * 1e-6, 1e-6};
}

// Four steps of `Opt` on CUDA params and on the same CPU params (matrices in a decayed group,
// vectors in one without decay), compared within tol(optimizer, k, param) for the
// optimizer's param k.
template <typename Opt, typename Options, typename TolFn>
void optimizer_against_cpu(Options options, const std::function<std::vector<Tensor>(Device)>& make,
                           TolFn tol) {
  std::vector<Tensor> cpu = make(kCPU), gpu = make(cuda(0));
  // The optimizer's order: the matrices' group, then the vectors'.
  std::vector<size_t> order;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < cpu.size(); ++i) {
      if ((cpu[i].dim() >= 2) == (pass == 0)) order.push_back(i);
    }
  }
  auto groups = [&](const std::vector<Tensor>& ps) {
    std::vector<optim::ParamGroup> g(2);
    for (size_t i : order) g[ps[i].dim() >= 2 ? 0 : 1].params.push_back(ps[i]);
    g[1].weight_decay = 0.0;
    return g;
  };
  Opt ocpu(groups(cpu), options), ogpu(groups(gpu), options);
  for (int step = 0; step < 4; ++step) {
    Generator gen(300 + step);
    for (size_t i = 0; i < cpu.size(); ++i) {
      // Param 2 skips step 1: its step count then differs from the others' (its own bucket).
      if (i == 2 && step == 1) {
        cpu[i].set_grad(Tensor());
        gpu[i].set_grad(Tensor());
        continue;
      }
      Tensor g = cast(randn(cpu[i].shape(), DType::f32, kCPU, &gen), cpu[i].dtype());
      cpu[i].set_grad(g);
      gpu[i].set_grad(g.to(cuda(0)));
    }
    const uint64_t version = gpu[0].storage()->version();
    ocpu.step();
    ogpu.step();
    CHECK(gpu[0].storage()->version() > version);
  }
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    CAPTURE(k);
    CHECK(ogpu.step_count(int64_t(k)) == ocpu.step_count(int64_t(k)));
    const Tol t = tol(ogpu, k, gpu[i]);
    const std::string at = std::to_string(k) + " " + shape_str(cpu[i].shape()) + " " +
                           std::string(dtype_name(cpu[i].dtype()));
    check_close(gpu[i], cpu[i], t.param, "param " + at, t.scaled);
    REQUIRE(ogpu.state(int64_t(k)).size() == ocpu.state(int64_t(k)).size());
    for (const auto& [name, want] : ocpu.state(int64_t(k))) {
      REQUIRE(ogpu.state(int64_t(k)).count(name) == 1);
      const Tensor& got = ogpu.state(int64_t(k)).at(name);
      CHECK(got.device() == cuda(0));
      // 8-bit codes compare as their integer values (check_close reads them as doubles).
      check_close(got, want, t.state, name + " of " + at);
    }
  }
}

template <typename Opt, typename Options>
void optimizer_against_cpu(Options options) {
  optimizer_against_cpu<Opt>(options, make_params,
                             [](const Opt&, size_t, const Tensor& p) { return fused_tol(p.dtype()); });
}

TEST_CASE("optim::AdamW steps CUDA params as it steps CPU params (buckets, masters)") {
  optimizer_against_cpu<optim::AdamW>(optim::AdamWOptions{.lr = 1e-2, .weight_decay = 0.1});
}

TEST_CASE("optim::SGD steps CUDA params as it steps CPU params") {
  optimizer_against_cpu<optim::SGD>(
      optim::SGDOptions{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true});
}

TEST_CASE("optim::AdamW8bit steps CUDA params as it steps CPU params: 8-bit state bitwise") {
  // Its kernel forbids the FMA (see adamw8bit_ above): a param with 8-bit state (from 1024
  // elements: {64, 33}, {130, 140}, {2, 40, 24}) is bitwise the CPU's, param and state; the
  // vectors keep f32 state and take adamw_, within its bounds.
  const optim::AdamW8bitOptions o{.lr = 1e-2, .weight_decay = 0.1, .min_8bit_numel = 1024};
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dt);
    int quantized = 0;
    optimizer_against_cpu<optim::AdamW8bit>(
        o, [dt](Device d) { return make_factored_params(d, dt); },
        [&](const optim::AdamW8bit& opt, size_t, const Tensor& p) {
          if (!opt.quantized(p)) return fused_tol(p.dtype());
          ++quantized;
          return Tol{0.0, 0.0, 0.0};
        });
    CHECK(quantized == 3);
  }
}

// Adafactor on CUDA takes the fused passes (adafactor_stats_, _norm_, _apply_) for its f32
// and f64 factored params, as on the CPU. Their sums over a row or a column (up to 140
// elements) and over the whole tensor run in another order on each device, so f32 results
// differ by rounding: 1e-5 of (|want| + max|want|) after four steps (140 x 2^-24 is 8e-6 at
// worst per sum), f64 1e-13. A bf16 param is updated by ops in f32 and rounded: one bf16 ulp
// plus that f32 bound; its state then follows the rounded param (the step scales by the
// param's RMS): one bf16 ulp too.
TEST_CASE("optim::Adafactor steps CUDA params as it steps CPU params: hf, torch, optax") {
  using optim::AdafactorMode;
  const std::vector<optim::AdafactorOptions> modes = {
      {.mode = AdafactorMode::hf, .beta1 = 0.9, .weight_decay = 0.01},
      {.mode = AdafactorMode::hf, .lr = 1e-2, .relative_step = false, .scale_parameter = false},
      {.mode = AdafactorMode::torch, .lr = 1e-2, .weight_decay = 0.01},
      {.mode = AdafactorMode::optax, .lr = 1e-2, .beta1 = 0.9, .weight_decay = 1e-3},
  };
  const std::vector<std::pair<DType, Tol>> dtypes = {{DType::f32, {1e-5, 1.0, 1e-5}},
                                                     {DType::f64, {1e-13, 1.0, 1e-13}},
                                                     {DType::bf16, {1.0 / 128, 128e-5, 1.0 / 128}}};
  int runs = 0;
  for (const auto& o : modes) {
    CAPTURE(optim::adafactor_mode_name(o.mode));
    for (const auto& entry : dtypes) {
      const DType dt = entry.first;  // (plain variables: lambdas capture them; clang < 16
      const Tol t = entry.second;    // rejects capturing a structured binding)
      CAPTURE(dt);
      optimizer_against_cpu<optim::Adafactor>(
          o, [dt](Device d) { return make_factored_params(d, dt); },
          [t](const optim::Adafactor&, size_t, const Tensor&) { return t; });
      ++runs;
    }
  }
  CHECK(runs == 12);
}

// Counts the fused passes' kernel calls on cuda:0 (a plain function pointer: KernelObserver).
std::atomic<int> g_fused_apply_calls{0};
void count_fused_apply(OpId op, Device device, bool begin, std::span<const Tensor>) {
  if (begin && op == OpId::adafactor_apply_ && device == cuda(0)) ++g_fused_apply_calls;
}

TEST_CASE("optim::Adafactor on CUDA: the fused passes equal the ops on the same device") {
  // fused = false runs the update as ops on CUDA: the same function, another summation order.
  // The fused optimizer calls adafactor_apply_ on cuda:0 once per factored param and step
  // ({64, 33}, {130, 140}, {2, 40, 24}: 3 x 3 steps per dtype); the ops one never does.
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dt);
    std::vector<Tensor> a = make_factored_params(cuda(0), dt);
    std::vector<Tensor> b = make_factored_params(cuda(0), dt);
    optim::AdafactorOptions o{.beta1 = 0.9, .weight_decay = 0.01};
    optim::Adafactor fused(a, o);
    o.fused = false;
    optim::Adafactor ops(b, o);
    for (int step = 0; step < 3; ++step) {
      Generator gen(700 + step);
      for (size_t i = 0; i < a.size(); ++i) {
        Tensor g = cast(randn(a[i].shape(), DType::f32, kCPU, &gen), dt).to(cuda(0));
        a[i].set_grad(g);
        b[i].set_grad(g.clone());
      }
      const KernelObserver previous = kernel_observer();
      set_kernel_observer(count_fused_apply);
      g_fused_apply_calls = 0;
      fused.step();
      const int fused_calls = g_fused_apply_calls.exchange(0);
      ops.step();
      const int ops_calls = g_fused_apply_calls.load();
      set_kernel_observer(previous);
      CHECK(fused_calls == 3);
      CHECK(ops_calls == 0);
    }
    for (size_t i = 0; i < a.size(); ++i) {
      check_close(a[i], b[i], dt == DType::f64 ? 1e-13 : 1e-5, "param " + std::to_string(i));
    }
  }
}

}  // namespace
