// Mixture of Experts (nn/moe.h) against an independent f64 reference written with loops per
// token (routing, capacity, experts, combine, the balancing and z losses); the gradients by
// gradcheck and, for the attached losses, by central differences of loss + aux; one expert
// against the dense MLP; the aux-loss-free bias update; attach_loss; bad options.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <cmath>
#include <numeric>
#include <optional>
#include <utility>

#include "autograd/autograd.h"
#include "nn/init.h"
#include "nn/moe.h"
#include "tensor/autocast.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tessera {
namespace {

using nn::MoeOptions;

struct Weights {
  int64_t E, C, H;
  Tensor router, fc_weight, fc_bias, proj_weight, proj_bias, bias;
  nn::MoeWeights moe() const { return {router, fc_weight, fc_bias, proj_weight, proj_bias, bias}; }
  std::vector<Tensor> trainable() const { return {router, fc_weight, fc_bias, proj_weight, proj_bias}; }
};

Weights random_weights(int64_t E, int64_t C, int64_t H, uint64_t seed, bool with_bias = false) {
  manual_seed(seed);
  Weights w;
  w.E = E;
  w.C = C;
  w.H = H;
  w.router = randn({E, C}, DType::f64).requires_grad_();
  w.fc_weight = (randn({E, C, H}, DType::f64) * 0.5).detach().requires_grad_();
  w.fc_bias = (randn({E, H}, DType::f64) * 0.1).detach().requires_grad_();
  w.proj_weight = (randn({E, H, C}, DType::f64) * 0.5).detach().requires_grad_();
  w.proj_bias = (randn({E, C}, DType::f64) * 0.1).detach().requires_grad_();
  w.bias = with_bias ? cast(randn({E}) * 0.3, DType::f32) : zeros({E});
  return w;
}

// ---- the reference ---------------------------------------------------------------------------

struct Ref {
  std::vector<double> out;
  std::vector<int64_t> counts;
  int64_t dropped = 0;
  double aux = 0, z = 0;
};

double gelu_tanh(double v) {
  return 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
}

Ref reference(const MoeOptions& o, const Weights& wt, const std::vector<double>& x, int64_t N) {
  const int64_t E = wt.E, C = wt.C, H = wt.H, k = o.top_k;
  const auto router = wt.router.to_vector<double>(), fc = wt.fc_weight.to_vector<double>(),
             fcb = wt.fc_bias.to_vector<double>(), proj = wt.proj_weight.to_vector<double>(),
             projb = wt.proj_bias.to_vector<double>(), bias = wt.bias.to_vector<double>();
  Ref r;
  r.out.assign(N * C, 0.0);
  r.counts.assign(E, 0);
  std::vector<std::vector<double>> probs(N);
  std::vector<int64_t> chosen(N * k);
  std::vector<double> gate(N * k);
  double zsum = 0;
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> logit(E), score(E);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t c = 0; c < C; ++c) logit[e] += x[t * C + c] * router[e * C + c];
    }
    const double m = *std::max_element(logit.begin(), logit.end());
    double se = 0;
    for (double l : logit) se += std::exp(l - m);
    zsum += std::pow(std::log(se) + m, 2);
    for (int64_t e = 0; e < E; ++e) {
      score[e] = o.score == MoeOptions::Score::softmax ? std::exp(logit[e] - m) / se
                                                       : 1.0 / (1.0 + std::exp(-logit[e]));
    }
    const double ssum = std::accumulate(score.begin(), score.end(), 0.0);
    probs[t].resize(E);
    for (int64_t e = 0; e < E; ++e) probs[t][e] = o.score == MoeOptions::Score::softmax ? score[e] : score[e] / ssum;
    std::vector<int64_t> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    // The selection is in the f32 scores plus the f32 bias when scores are f32; here f64.
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
      return score[a] + bias[a] > score[b] + bias[b];
    });
    double gsum = 0;
    for (int64_t j = 0; j < k; ++j) gsum += score[idx[j]];
    for (int64_t j = 0; j < k; ++j) {
      chosen[t * k + j] = idx[j];
      gate[t * k + j] = (o.renormalize && k > 1) ? score[idx[j]] / gsum : score[idx[j]];
      ++r.counts[idx[j]];
    }
  }
  // Capacity per (group, expert), assignments in token order.
  const bool capped = o.capacity_factor > 0;
  const int64_t groups = capped ? o.groups : 1, per_group = N / groups;
  const int64_t cap = capped ? static_cast<int64_t>(std::ceil(per_group * k * o.capacity_factor / E)) : N * k;
  std::vector<bool> kept(N * k, true);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t e = 0; e < E; ++e) {
      std::vector<int64_t> a;
      for (int64_t t = g * per_group; t < (g + 1) * per_group; ++t) {
        for (int64_t j = 0; j < k; ++j) {
          if (chosen[t * k + j] == e) a.push_back(t * k + j);
        }
      }
      if (static_cast<int64_t>(a.size()) <= cap) continue;
      if (o.drop_policy == MoeOptions::DropPolicy::score) {
        std::stable_sort(a.begin(), a.end(), [&](int64_t p, int64_t q) { return gate[p] > gate[q]; });
      }
      for (size_t i = cap; i < a.size(); ++i) kept[a[i]] = false;
      r.dropped += static_cast<int64_t>(a.size()) - cap;
    }
  }
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      if (!kept[t * k + j]) continue;
      const int64_t e = chosen[t * k + j];
      std::vector<double> h(H);
      for (int64_t q = 0; q < H; ++q) {
        double acc = fcb[e * H + q];
        for (int64_t c = 0; c < C; ++c) acc += x[t * C + c] * fc[(e * C + c) * H + q];
        h[q] = gelu_tanh(acc);
      }
      for (int64_t c = 0; c < C; ++c) {
        double acc = projb[e * C + c];
        for (int64_t q = 0; q < H; ++q) acc += h[q] * proj[(e * H + q) * C + c];
        r.out[t * C + c] += gate[t * k + j] * acc;
      }
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    double p = 0;
    for (int64_t t = 0; t < N; ++t) p += probs[t][e];
    r.aux += o.aux_loss * E * (static_cast<double>(r.counts[e]) / (N * k)) * (p / N);
  }
  r.z = o.z_loss * zsum / N;
  return r;
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > tol * (1.0 + std::abs(want[i]))) {
      FAIL_CHECK(what << " element " << i << ": got " << got[i] << ", want " << want[i]);
      return;
    }
  }
}

struct Config {
  const char* label;
  MoeOptions o;
  bool bias = false;
};

std::vector<Config> configs() {
  std::vector<Config> c;
  MoeOptions base;
  base.experts = 4;
  base.hidden = 6;
  base.aux_loss = 0.01;
  base.z_loss = 0.001;
  c.push_back({"softmax top-2 renormalised, dropless", base});
  MoeOptions one = base;
  one.top_k = 1;
  c.push_back({"softmax top-1 (Switch), dropless", one});
  MoeOptions sig = base;
  sig.score = MoeOptions::Score::sigmoid;
  c.push_back({"sigmoid top-2 with a selection bias (DeepSeek-V3)", sig, true});
  MoeOptions cap = base;
  cap.capacity_factor = 1.0;
  cap.groups = 2;
  c.push_back({"capacity 1.0, 2 groups, by position", cap});
  MoeOptions cap_s = cap;
  cap_s.drop_policy = MoeOptions::DropPolicy::score;
  cap_s.capacity_factor = 0.75;
  c.push_back({"capacity 0.75, 2 groups, by score", cap_s});
  MoeOptions no_renorm = base;
  no_renorm.renormalize = false;
  no_renorm.top_k = 3;
  c.push_back({"top-3 without renormalisation", no_renorm});
  return c;
}

TEST_CASE("moe: forward, counts, drops and losses equal the per-token f64 reference") {
  const int64_t N = 12, C = 5, E = 4, H = 6;
  int ran = 0;
  for (const Config& cfg : configs()) {
    CAPTURE(cfg.label);
    const Weights w = random_weights(E, C, H, 11, cfg.bias);
    manual_seed(5);
    const Tensor x = randn({N, C}, DType::f64);
    nn::MoeStatsScope stats;
    const Tensor y = nn::moe_forward(cfg.o, w.moe(), x, "layer");
    const Ref r = reference(cfg.o, w, x.to_vector<double>(), N);
    check_close(y.to_vector<double>(), r.out, 1e-12, "output");
    REQUIRE(stats.layers().size() == 1);
    const nn::MoeLayerStats& s = stats.layers()[0];
    CHECK(s.counts == r.counts);
    CHECK(s.dropped == r.dropped);
    CHECK(s.tokens == N);
    CHECK(s.aux_loss == doctest::Approx(r.aux).epsilon(1e-13));
    CHECK(s.z_loss == doctest::Approx(r.z).epsilon(1e-13));
    if (cfg.o.capacity_factor > 0) CHECK(r.dropped > 0);  // the case drops something
    ++ran;
  }
  CHECK(ran == 6);
}

TEST_CASE("moe: uniform routing gives an aux loss of alpha") {
  // Token t's logits favour expert t mod E symmetrically: every expert gets N k / E
  // assignments and a mean probability of exactly 1 / E up to rounding.
  const int64_t E = 4, C = 4, N = 8;
  MoeOptions o;
  o.experts = E;
  o.top_k = 1;
  o.hidden = 3;
  o.aux_loss = 0.02;
  Weights w = random_weights(E, C, 3, 3);
  std::vector<double> eye(E * C, 0.0);
  for (int64_t e = 0; e < E; ++e) eye[e * C + e] = 1.0;
  w.router = Tensor::from_vector(eye, {E, C});
  std::vector<double> xv(N * C, 0.0);
  for (int64_t t = 0; t < N; ++t) xv[t * C + t % E] = 2.0;
  nn::MoeStatsScope stats;
  nn::moe_forward(o, w.moe(), Tensor::from_vector(xv, {N, C}), "uniform");
  const nn::MoeLayerStats& s = stats.layers().at(0);
  CHECK(s.counts == std::vector<int64_t>{2, 2, 2, 2});
  CHECK(s.imbalance() == 1.0);
  CHECK(s.aux_loss == doctest::Approx(0.02).epsilon(1e-15));
}

TEST_CASE("moe: gradcheck of the layer in f64 (router, top-k gates, experts, combine)") {
  const int64_t N = 6, C = 3, E = 4, H = 5;
  int ran = 0;
  for (const Config& cfg : configs()) {
    CAPTURE(cfg.label);
    MoeOptions o = cfg.o;
    o.aux_loss = 0;  // the attached losses are checked below
    o.z_loss = 0;
    const Weights w = random_weights(E, C, H, 21, cfg.bias);
    manual_seed(9);
    const Tensor x = randn({N, C}, DType::f64).requires_grad_();
    std::vector<Tensor> inputs = w.trainable();
    inputs.insert(inputs.begin(), x);
    const auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) {
          return nn::moe_forward(o, {in[1], in[2], in[3], in[4], in[5], w.bias}, in[0], "g");
        },
        inputs);
    CHECK_MESSAGE(r.ok, r.message);
    ++ran;
  }
  CHECK(ran == 6);
}

TEST_CASE("moe: the attached losses train as if added to the loss (central differences)") {
  const int64_t N = 6, C = 3, E = 4, H = 5;
  MoeOptions o;
  o.experts = E;
  o.hidden = H;
  o.aux_loss = 0.3;  // large, so their gradient is visible against the output's
  o.z_loss = 0.2;
  const Weights w = random_weights(E, C, H, 31);
  manual_seed(4);
  const Tensor x = randn({N, C}, DType::f64).requires_grad_();
  const Tensor proj = randn({N, C}, DType::f64);
  // L = <y, proj> + aux + z, the value from the stats (one device: the attached value).
  const auto total = [&](const Tensor& xin, const Tensor& router) {
    nn::MoeStatsScope stats;
    nn::MoeWeights mw = w.moe();
    mw.router = router;
    const Tensor y = nn::moe_forward(o, mw, xin, "a");
    return std::pair{sum(y * proj), stats.layers().at(0).aux_loss + stats.layers().at(0).z_loss};
  };
  {
    const autograd::AuxLossScale scale(1.0);
    total(x, w.router).first.backward();
  }
  const double eps = 1e-6;
  int checked = 0;
  for (const auto& entry : {std::pair{x, "x"}, std::pair{w.router, "router"}}) {
    const Tensor t = entry.first;  // (plain variables: lambdas capture them; clang < 16
    const char* name = entry.second;  // rejects capturing a structured binding)
    const std::vector<double> grad = t.grad().to_vector<double>();
    std::vector<double> base = t.to_vector<double>();
    for (size_t i = 0; i < base.size(); ++i) {
      auto at = [&](double d) {
        std::vector<double> v = base;
        v[i] += d;
        const Tensor p = Tensor::from_vector(v, t.shape());
        const NoGradGuard no_grad;
        const auto [l, aux] = std::string(name) == "x" ? total(p, w.router) : total(x, p);
        return l.item<double>() + aux;
      };
      const double numeric = (at(eps) - at(-eps)) / (2 * eps);
      CHECK_MESSAGE(std::abs(grad[i] - numeric) <= 1e-7 + 1e-5 * std::abs(numeric),
                    name << "[" << i << "]: analytic " << grad[i] << " numeric " << numeric);
      ++checked;
    }
  }
  CHECK(checked == N * C + E * C);
}

TEST_CASE("moe: one expert with top-1 is the dense MLP (values and gradients)") {
  const int64_t N = 7, C = 4, H = 8;
  MoeOptions o;
  o.experts = 1;
  o.top_k = 1;
  o.hidden = H;
  const Weights w = random_weights(1, C, H, 41);
  manual_seed(2);
  const Tensor x = randn({N, C}, DType::f64).requires_grad_();
  const Tensor y = nn::moe_forward(o, w.moe(), x, "one");
  const auto first = [](const Tensor& t) { return squeeze(slice(t, 0, 0, 1), {0}); };
  const Tensor dense =
      matmul(gelu(matmul(x, first(w.fc_weight)) + first(w.fc_bias), true), first(w.proj_weight)) +
      first(w.proj_bias);
  check_close(y.to_vector<double>(), dense.to_vector<double>(), 1e-13, "output");
  const auto grads = [&](const Tensor& out) {
    const std::vector<Tensor> g = autograd::grad({sum(out * out)}, {x, w.fc_weight, w.proj_weight});
    std::vector<std::vector<double>> v;
    for (const Tensor& t : g) v.push_back(t.to_vector<double>());
    return v;
  };
  const auto a = grads(y), b = grads(dense);
  for (size_t i = 0; i < a.size(); ++i) check_close(a[i], b[i], 1e-12, "gradient");
}

TEST_CASE("moe: the module on [B, T, C], autocast bf16 and the aux-loss-free bias update") {
  manual_seed(1);
  MoeOptions o;
  o.experts = 4;
  o.top_k = 2;
  o.bias_rate = 0.01;
  nn::MixtureOfExperts moe(8, o);
  CHECK(moe.fc_weight.shape() == Shape{4, 8, 32});
  const auto names = moe.state_dict();
  CHECK(names.count("router") == 1);
  CHECK(names.count("selection_bias") == 1);
  const Tensor x = randn({2, 3, 8});
  const Tensor y = moe.forward(x);
  CHECK(y.shape() == x.shape());
  {
    AutocastGuard amp(DType::bf16);
    const Tensor yb = moe.forward(x);
    CHECK(yb.dtype() == DType::f32);
    const std::vector<float> a = y.to_vector<float>(), b = yb.to_vector<float>();
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
    CHECK(worst < 0.05);  // bf16 experts (8 bits of mantissa) on O(1) outputs
  }
  Tensor b = moe.selection_bias;
  nn::update_selection_bias(b, {5, 1, 3, 3}, 0.01);
  const std::vector<float> nb = moe.selection_bias.to_vector<float>();
  CHECK(nb == std::vector<float>{-0.01f, 0.01f, 0.0f, 0.0f});
}

TEST_CASE("moe: attach_loss gives the loss the scope's scale and passes the gradient on") {
  const Tensor x = randn({3}).requires_grad_();
  const Tensor a = randn({}).requires_grad_();
  {
    const autograd::AuxLossScale scale(0.25);
    const Tensor y = autograd::attach_loss(x * 2.0, a * 3.0);
    sum(y).backward();
  }
  CHECK(x.grad().to_vector<float>() == std::vector<float>{2, 2, 2});
  CHECK(a.grad().item<float>() == 0.75f);
  CHECK_THROWS_AS(autograd::attach_loss(x, randn({2})), Error);
}

// Expert parallelism's build: under a MoeBuildScope the layer holds experts [first, first +
// count) with exactly the values the whole layer's construction gives them, the router whole,
// and the generator where the whole construction leaves it (the next draw is the same);
// keep_experts on such a layer changes nothing, on a whole one cuts the same values.
TEST_CASE("moe: a layer built with some of its experts holds one device's values for them") {
  nn::MoeOptions o;
  o.experts = 8;
  o.hidden = 12;
  manual_seed(11);
  nn::MixtureOfExperts whole(6, o, "moe", DType::f64);
  const Tensor next_whole = rand({3}, DType::f64);
  int cases = 0;
  for (const auto& range : {std::pair{0, 2}, std::pair{2, 2}, std::pair{6, 2}, std::pair{4, 4}, std::pair{3, 1}}) {
    const int64_t first = range.first, count = range.second;  // (captured: no structured binding)
    CAPTURE(first);
    CAPTURE(count);
    manual_seed(11);
    std::optional<nn::MixtureOfExperts> part;
    {
      const nn::MoeBuildScope only(first, count);
      part.emplace(6, o, "moe", DType::f64);
    }
    CHECK(rand({3}, DType::f64).to_vector<double>() == next_whole.to_vector<double>());
    CHECK(part->first_expert == first);
    CHECK(part->router.to_vector<double>() == whole.router.to_vector<double>());
    const auto rows = [&](const Tensor& t) { return t.narrow(0, first, count).contiguous().to_vector<double>(); };
    CHECK(part->fc_weight.shape() == Shape{count, 6, 12});
    CHECK(part->fc_weight.to_vector<double>() == rows(whole.fc_weight));
    CHECK(part->proj_weight.to_vector<double>() == rows(whole.proj_weight));
    CHECK(part->fc_bias.shape() == Shape{count, 12});
    CHECK(part->proj_bias.shape() == Shape{count, 6});
    // A re-initialisation of the experts (GPT's scheme) draws their part of the whole draw.
    manual_seed(12);
    Tensor w = whole.fc_weight.detach().clone();
    nn::init::normal_(w, 0.0, 0.02);
    const Tensor after_whole = rand({1}, DType::f64);
    manual_seed(12);
    Tensor p = part->fc_weight.detach().clone();
    part->init_experts(p, [](Tensor& t) { nn::init::normal_(t, 0.0, 0.02); });
    CHECK(p.to_vector<double>() == rows(w));
    CHECK(rand({1}, DType::f64).to_vector<double>() == after_whole.to_vector<double>());
    part->keep_experts(first, count);  // already these: nothing changes
    CHECK(part->fc_weight.to_vector<double>() == rows(whole.fc_weight));
    manual_seed(11);
    nn::MixtureOfExperts cut(6, o, "moe", DType::f64);
    cut.keep_experts(first, count);
    CHECK(cut.first_expert == first);
    CHECK(cut.fc_weight.to_vector<double>() == part->fc_weight.to_vector<double>());
    CHECK(cut.proj_weight.to_vector<double>() == part->proj_weight.to_vector<double>());
    CHECK(cut.named_parameters().size() == part->named_parameters().size());
    ++cases;
  }
  CHECK(cases == 5);
  // A layer holding other experts is not cut again, and without a dispatch it cannot run.
  manual_seed(11);
  const nn::MoeBuildScope only(2, 2);
  nn::MixtureOfExperts two(6, o, "moe2", DType::f64);
  const auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string cut_again = message([&] { two.keep_experts(4, 2); });
  CHECK_MESSAGE(cut_again.find("keep_experts on a layer that holds 2 of its 8 experts already") !=
                    std::string::npos, cut_again);
  const std::string alone = message([&] { two.forward(randn({4, 6}, DType::f64)); });
  CHECK_MESSAGE(alone.find("its tensors hold 2 of the 8 experts") != std::string::npos, alone);
  // Under a dispatch that runs other experts here, the layer refuses rather than run the
  // wrong weights.
  struct Elsewhere final : nn::MoeDispatch {
    Tensor run(const Tensor& rows, const std::vector<int64_t>& sizes, const nn::ExpertsFn& experts) override {
      return experts(rows, std::vector<int64_t>(sizes.begin() + 4, sizes.begin() + 6), 4);
    }
    std::pair<int64_t, int64_t> local_experts() const override { return {4, 2}; }
  } elsewhere;
  const nn::MoeDispatchScope scope(&elsewhere);
  const std::string wrong = message([&] { two.forward(randn({4, 6}, DType::f64)); });
  CHECK_MESSAGE(wrong.find("holds experts [2, 4) but the dispatch runs [4, 6) here") != std::string::npos,
                wrong);
}

TEST_CASE("moe: bad options and inputs are refused, naming the field") {
  const auto refused = [](MoeOptions o, const char* what) {
    try {
      o.validate(8);
      FAIL_CHECK("accepted " << what);
    } catch (const Error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(what) != std::string::npos, e.what());
    }
  };
  MoeOptions o;
  o.experts = 0;
  refused(o, "experts");
  o = {};
  o.top_k = 9;
  refused(o, "top_k");
  o = {};
  o.capacity_factor = -1;
  refused(o, "capacity_factor");
  o = {};
  o.groups = 0;
  refused(o, "groups");
  o = {};
  o.aux_loss = -0.1;
  refused(o, "aux_loss");
  MoeOptions cap;
  cap.experts = 2;
  cap.capacity_factor = 1;
  cap.groups = 4;
  const Weights w = random_weights(2, 3, 4, 1);
  CHECK_THROWS_WITH_AS(nn::moe_forward(cap, w.moe(), randn({6, 3}, DType::f64), "m"),
                       doctest::Contains("groups = 4"), Error);
  CHECK_THROWS_AS(nn::moe_forward(MoeOptions{}, w.moe(), randn({6, 4}, DType::f64), "m"), Error);
}

}  // namespace
}  // namespace tessera
