// 8-bit AdamW (optim/adamw8bit.h, the fused adamw8bit_ op, tensor/quant8.h) against
// independent references (tests/reference: the maps decoded from their bit patterns, the
// nearest code by a linear scan of midpoints, the step emulated operation by operation):
// the maps and codes exactly; the optimizer's steps bitwise over several steps, on tensors
// of 8-bit and f32 state; its state bytes against the formula; resume from state_dict (and
// through a safetensors file) bitwise; options and errors.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "nn/safetensors.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "tensor/ops.h"
#include "tensor/quant8.h"
#include "tensor/random.h"
#include "tests/reference/reference.h"
#include "tests/testing.h"

namespace tessera::optim {
namespace {

using testing::contains;
using testing::error_of;

ref::NdArray nd(const Tensor& t) { return ref::NdArray::of(t.shape(), t.to_vector<double>()); }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         cast(a, DType::f64).to_vector<double>() == cast(b, DType::f64).to_vector<double>();
}

TEST_CASE("the 8-bit maps are the dynamic tree maps, and codes are the nearest entries") {
  for (bool is_signed : {true, false}) {
    CAPTURE(is_signed);
    const Quant8Map& m =
        quant8_map(is_signed ? Quant8Kind::signed_dynamic : Quant8Kind::unsigned_dynamic);
    const std::vector<double> want = ref::dynamic_map(is_signed);
    REQUIRE(want.size() == 256);
    for (int k = 0; k < 256; ++k) {
      CAPTURE(k);
      CHECK(static_cast<double>(m.values[k]) == want[k]);
      if (k > 0) CHECK(want[k] > want[k - 1]);  // 256 distinct values
    }
    CHECK(m.values[m.zero_code()] == 0.0f);
    CHECK(m.zero_code() == (is_signed ? 127 : 0));
    CHECK(want.back() == 1.0);
    // The largest magnitude below 1, and the smallest nonzero value.
    auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
    if (is_signed) {
      CHECK(want[0] == -f32(0.1 + 0.9 * 63.5 / 64));
      CHECK(want[254] == f32(0.1 + 0.9 * 63.5 / 64));
      CHECK(want[128] == f32(1e-6 * (0.1 + 0.9 * 0.5)));
    } else {
      CHECK(want[0] == 0.0);
      CHECK(want[254] == f32(0.1 + 0.9 * 127.5 / 128));
      CHECK(want[1] == f32(1e-6 * (0.1 + 0.9 * 0.5 / 2)));
    }
    // Every midpoint, its f32 neighbours, the map's values, and random values: the code
    // (binary search over thresholds) is the nearest entry (linear scan), in f32 and f64.
    std::vector<float> xs;
    for (int k = 0; k < 255; ++k) {
      const double mid = (want[k] + want[k + 1]) / 2;
      const float f = static_cast<float>(mid);
      for (float x : {f, std::nextafter(f, -2.0f), std::nextafter(f, 2.0f)}) xs.push_back(x);
      xs.push_back(static_cast<float>(want[k]));
    }
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> u(is_signed ? -1.0f : 0.0f, 1.0f);
    for (int i = 0; i < 20000; ++i) xs.push_back(u(gen));
    for (int i = 0; i < 2000; ++i) xs.push_back(u(gen) * 1e-5f);  // the finest decades
    xs.push_back(1.0f);
    xs.push_back(0.0f);
    int64_t mismatches = 0, mismatches64 = 0;
    for (float x : xs) {
      mismatches += m.code(x) != ref::nearest_code(want, x);
      const double d = static_cast<double>(x) * (1 + 1e-12);
      mismatches64 += m.code(d) != ref::nearest_code(want, d);
    }
    CHECK(mismatches == 0);
    CHECK(mismatches64 == 0);
  }
}

// One quantization of a whole tensor through the op: a step with lr 0, beta1 = beta2 = 0
// leaves m = g and v = g^2, so the codes are those of g / max|g| and g^2 / max g^2 per block.
TEST_CASE("adamw8bit_ quantizes block by block: codes and absmax of an independent f64 pass") {
  manual_seed(3);
  const int64_t n = 1000;  // 3 whole blocks and a short one
  const Tensor g = randn({n}) * 0.3;
  const Tensor p = zeros({n});
  const Tensor c1 = full({n}, 127, DType::u8), c2 = zeros({n}, DType::u8);
  const Tensor a1 = zeros({4}), a2 = zeros({4});
  adamw8bit_(p, g, c1, c2, a1, a2, 1, 0.0, 0.0, 0.0, 1e-8, 0.0);
  const std::vector<double> map1 = ref::dynamic_map(true), map2 = ref::dynamic_map(false);
  const std::vector<float> gv = g.to_vector<float>();
  const std::vector<double> got1 = c1.to_vector<double>(), got2 = c2.to_vector<double>();
  for (int64_t b = 0; b < 4; ++b) {
    double max1 = 0, max2 = 0;
    for (int64_t i = b * 256; i < std::min<int64_t>(n, (b + 1) * 256); ++i) {
      max1 = std::max(max1, std::fabs(double(gv[i])));
      max2 = std::max(max2, double(gv[i] * gv[i]));
    }
    CHECK(a1.to_vector<double>()[b] == max1);
    CHECK(a2.to_vector<double>()[b] == max2);
    int64_t wrong = 0;
    double worst = 0;
    for (int64_t i = b * 256; i < std::min<int64_t>(n, (b + 1) * 256); ++i) {
      const float x1 = gv[i] / float(max1), x2 = (gv[i] * gv[i]) / float(max2);
      wrong += got1[i] != ref::nearest_code(map1, x1);
      wrong += got2[i] != ref::nearest_code(map2, x2);
      // Dequantized, the first moment is within half a map step of the value.
      worst = std::max(worst, std::fabs(map1[size_t(got1[i])] * max1 - gv[i]) / max1);
    }
    CHECK(wrong == 0);
    CHECK(worst < 0.9 / 64 / 2 + 1e-7);  // the coarsest step of the signed map, halved
  }
}

TEST_CASE("adamw8bit_ with a NaN gradient: the scales skip it, its codes are 0, as the reference") {
  // A NaN moment is left out of its block's absmax (the running max skips it) and takes
  // code 0 (no threshold is <= NaN); the parameter becomes NaN. Every path agrees: the
  // vectorised kernel (f32 state) and the emulating reference, in f32 and f64.
  for (DType dt : {DType::f32, DType::f64}) {
    CAPTURE(dt);
    manual_seed(4);
    const int64_t n = 600;
    std::vector<double> gv = randn({n}, DType::f64).to_vector<double>();
    // In the first and the last 16 elements of a block (the vector kernel's first and last
    // chunk), and in the short last block's last chunk.
    for (int64_t i : {3, 250, 300, 597}) gv[i] = std::numeric_limits<double>::quiet_NaN();
    const Tensor p = randn({n}).cast(dt), g = Tensor::from_vector<double>(gv, {n}).cast(dt);
    const Tensor c1 = full({n}, 127, DType::u8), c2 = zeros({n}, DType::u8);
    const DType st = dt == DType::f64 ? DType::f64 : DType::f32;
    const Tensor a1 = zeros({3}, st), a2 = zeros({3}, st);
    const std::vector<ref::NdArray> in = {nd(p), nd(g), nd(c1), nd(c2), nd(a1), nd(a2)};
    adamw8bit_(p, g, c1, c2, a1, a2, 1, 1e-2, 0.9, 0.999, 1e-8, 0.1);
    const std::vector<ref::NdArray> want = ref::adamw8bit(in, 1, 1e-2, 0.9, 0.999, 1e-8, 0.1, dt);
    const std::vector<Tensor> got = {p, c1, c2, a1, a2};
    for (size_t k = 0; k < got.size(); ++k) {
      CAPTURE(k);
      const std::vector<double> v = cast(got[k], DType::f64).to_vector<double>();
      int64_t differ = 0;
      for (size_t i = 0; i < v.size(); ++i) {
        const double w = want[k].data[i];
        differ += !(v[i] == w || (std::isnan(v[i]) && std::isnan(w)));
      }
      CHECK(differ == 0);
    }
    CHECK(std::isnan(p.to_vector<double>()[3]));
    CHECK(c1.to_vector<double>()[3] == 0);
    CHECK(std::isfinite(a1.to_vector<double>()[0]));
  }
}

struct Model {
  std::vector<Tensor> params;
  std::vector<std::string> names;
};

// A big matrix (8-bit state, a short last block), an "embedding" (8-bit unless f32_state),
// a vector under 4096 elements (f32 state).
Model make_model(DType dt = DType::f32) {
  manual_seed(5);
  Model m;
  m.params = {randn({70, 90}).cast(dt), randn({50, 100}).cast(dt), randn({300}).cast(dt)};
  m.names = {"w", "wte", "b"};
  for (Tensor& p : m.params) p.requires_grad_();
  return m;
}

std::vector<ParamGroup> groups_of(const Model& m) {
  ParamGroup g{m.params, m.names, ParamGroup::kInherit, ParamGroup::kInherit};
  return {g};
}

void set_grads(const Model& m, int step) {
  manual_seed(100 + static_cast<uint64_t>(step));
  for (const Tensor& p : m.params) p.set_grad(randn(p.shape()).cast(p.dtype()) * 0.1);
}

TEST_CASE("AdamW8bit: steps equal the emulated reference bitwise, 8-bit and f32 state") {
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dt);
    Model m = make_model(dt);
    const AdamW8bitOptions o{.lr = 1e-2, .betas = {0.9, 0.99}, .eps = 1e-8, .weight_decay = 0.1};
    AdamW8bit opt(groups_of(m), o);
    // The reference state, carried by hand.
    std::vector<std::vector<ref::NdArray>> st(3);
    for (size_t i = 0; i < 3; ++i) {
      const Tensor& p = m.params[i];
      const int64_t blocks = quant8_blocks(p.numel());
      ref::NdArray master = nd(cast(p, DType::f32));
      if (i < 2) {
        st[i] = {nd(p), ref::NdArray(), ref::NdArray::zeros(p.shape(), 127), ref::NdArray::zeros(p.shape()),
                 ref::NdArray::zeros({blocks}), ref::NdArray::zeros({blocks}),
                 dt == DType::f32 ? ref::NdArray::absent() : master};
      } else {
        st[i] = {master, ref::NdArray(), ref::NdArray::zeros(p.shape()), ref::NdArray::zeros(p.shape())};
      }
    }
    for (int step = 1; step <= 6; ++step) {
      set_grads(m, step);
      for (size_t i = 0; i < 3; ++i) st[i][1] = nd(m.params[i].grad());
      opt.step();
      for (size_t i = 0; i < 2; ++i) {
        CAPTURE(i);
        const std::vector<ref::NdArray> want = ref::adamw8bit(st[i], step, o.lr, 0.9, 0.99, o.eps, o.weight_decay, dt);
        const auto& s = opt.state(static_cast<int64_t>(i));
        CHECK(nd(m.params[i]).data == want[0].data);
        CHECK(nd(s.at("exp_avg")).data == want[1].data);
        CHECK(nd(s.at("exp_avg_sq")).data == want[2].data);
        CHECK(nd(s.at("exp_avg_absmax")).data == want[3].data);
        CHECK(nd(s.at("exp_avg_sq_absmax")).data == want[4].data);
        if (dt != DType::f32) CHECK(nd(s.at("master")).data == want[5].data);
        st[i] = {want[0], {}, want[1], want[2], want[3], want[4],
                 dt == DType::f32 ? ref::NdArray::absent() : want[5]};
      }
      // The small tensor: AdamW's f32 state, within the f64 reference's rounding.
      const std::vector<ref::NdArray> want =
          ref::adamw(st[2][0], st[2][1], st[2][2], st[2][3], step, o.lr, 0.9, 0.99, o.eps, o.weight_decay);
      const auto& s = opt.state(2);
      CHECK(s.at("exp_avg").dtype() == DType::f32);
      const std::vector<double> got = cast(dt == DType::f32 ? m.params[2] : s.at("master"), DType::f64).to_vector<double>();
      double err = 0;
      for (size_t k = 0; k < got.size(); ++k) err = std::max(err, std::fabs(got[k] - want[0].data[k]));
      CHECK(err < 1e-5);
      st[2] = {nd(cast(dt == DType::f32 ? m.params[2] : s.at("master"), DType::f32)), {},
               nd(s.at("exp_avg")), nd(s.at("exp_avg_sq"))};
    }
  }
}

TEST_CASE("AdamW8bit: which tensors hold 8-bit state, and their bytes against the formula") {
  Model m = make_model();
  AdamW8bitOptions o;
  o.f32_state = [](const std::string& name) { return name == "wte"; };
  AdamW8bit opt(groups_of(m), o);
  set_grads(m, 1);
  opt.step();
  CHECK(opt.quantized(m.params[0]));
  CHECK_FALSE(opt.quantized(m.params[1]));  // named by f32_state
  CHECK_FALSE(opt.quantized(m.params[2]));  // under min_8bit_numel
  CHECK(opt.state(0).at("exp_avg").dtype() == DType::u8);
  CHECK(opt.state(0).at("exp_avg_absmax").shape() == Shape{25});  // ceil(6300 / 256)
  CHECK(opt.state(1).at("exp_avg").dtype() == DType::f32);
  // 8-bit: 2 bytes per element + 2 f32 scales per 256; f32: 8 bytes per element.
  const int64_t want = (2 * 6300 + 8 * 25) + 8 * 5000 + 8 * 300;
  CHECK(opt.state_bytes() == want);
  // The whole of it 8-bit: 2 + 8/256 bytes per element but the small tensor's 8.
  Model m2 = make_model();
  AdamW8bit all(groups_of(m2));
  set_grads(m2, 1);
  all.step();
  CHECK(all.state_bytes() == (2 * 6300 + 8 * 25) + (2 * 5000 + 8 * 20) + 8 * 300);
}

TEST_CASE("AdamW8bit: resuming from state_dict (and a safetensors file) continues bitwise") {
  for (DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dt);
    Model a = make_model(dt), b = make_model(dt);
    AdamW8bit oa(groups_of(a)), ob(groups_of(b));
    for (int s = 1; s <= 3; ++s) {
      set_grads(a, s);
      set_grads(b, s);
      oa.step();
      ob.step();
    }
    const std::string path =
        (std::filesystem::path(testing::temp_dir("adamw8bit")) / "opt.safetensors").string();
    nn::save_safetensors(path, ob.state_dict());
    Model c = make_model(dt);
    for (size_t i = 0; i < c.params.size(); ++i) {
      NoGradGuard ng;
      c.params[i].copy_(b.params[i]);
    }
    AdamW8bit oc(groups_of(c));
    oc.load_state_dict(nn::load_safetensors(path).tensors);
    CHECK(nn::load_safetensors(path).tensors.at("state.0.exp_avg").dtype() == DType::u8);
    for (int s = 4; s <= 6; ++s) {
      set_grads(a, s);
      set_grads(c, s);
      oa.step();
      oc.step();
    }
    for (size_t i = 0; i < a.params.size(); ++i) {
      CAPTURE(i);
      CHECK(same_bits(a.params[i], c.params[i]));
      for (const auto& entry : oa.state(static_cast<int64_t>(i))) {
        const std::string& name = entry.first;  // (CAPTURE captures it: no structured binding)
        const Tensor& t = entry.second;
        CAPTURE(name);
        CHECK(same_bits(t, oc.state(static_cast<int64_t>(i)).at(name)));
      }
    }
  }
}

TEST_CASE("AdamW8bit: tracks AdamW on a least-squares problem") {
  // 8-bit state changes the trajectory only by the moments' quantization error.
  manual_seed(9);
  const Tensor x = randn({256, 64}), w_true = randn({64, 80}), y = matmul(x, w_true);
  double final_loss[2];
  for (int k = 0; k < 2; ++k) {
    manual_seed(10);
    Tensor w = (randn({64, 80}) * 0.1).requires_grad_();
    std::unique_ptr<Optimizer> opt;
    if (k == 0) opt = std::make_unique<AdamW>(std::vector<Tensor>{w}, AdamWOptions{.lr = 3e-2, .weight_decay = 0.0});
    else opt = std::make_unique<AdamW8bit>(std::vector<Tensor>{w}, AdamW8bitOptions{.lr = 3e-2, .weight_decay = 0.0});
    Tensor loss;
    for (int s = 0; s < 200; ++s) {
      opt->zero_grad();
      const Tensor d = matmul(x, w) - y;
      loss = mean(d * d);
      loss.backward();
      opt->step();
    }
    final_loss[k] = loss.item<float>();
  }
  MESSAGE("least squares after 200 steps: AdamW " << final_loss[0] << ", AdamW8bit " << final_loss[1]);
  CHECK(final_loss[0] < 0.05);  // started near 64
  CHECK(final_loss[1] < 0.05);
}

TEST_CASE("AdamW8bit: bad options and states are errors naming the value") {
  Model m = make_model();
  CHECK(contains(error_of([&] { AdamW8bit(groups_of(m), {.lr = -1}); }), "invalid learning rate -1"));
  CHECK(contains(error_of([&] { AdamW8bit(groups_of(m), {.betas = {0.9, 1.0}}); }), "invalid beta2 1"));
  CHECK(contains(error_of([&] { AdamW8bit(groups_of(m), {.min_8bit_numel = -5}); }),
                 "invalid min_8bit_numel -5"));
  // A state dict saved with another min_8bit_numel would put other tensors in 8 bits.
  AdamW8bit a(groups_of(m));
  set_grads(m, 1);
  a.step();
  AdamW8bit b(groups_of(m), {.min_8bit_numel = 100});
  CHECK(contains(error_of([&] { b.load_state_dict(a.state_dict()); }),
                 "saved with min_8bit_numel 4096, this optimizer has 100"));
}

}  // namespace
}  // namespace tessera::optim
