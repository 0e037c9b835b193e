// autograd::checkpoint (activation recomputation) on a small MLP-like residual stack:
//   h <- h + matmul(dropout(gelu(matmul(layer_norm(h), w1))), w2)     (per layer)
// Checkpointed runs (flat, nested, retain_graph) must give bitwise the same loss and the same
// parameter and input gradients as the plain run, dropout included (the recomputation replays
// the generator's counters), while the forward keeps far fewer bytes alive.
#include <doctest/doctest.h>

#include <bit>
#include <cstdint>
#include <set>
#include <vector>

#include "autograd/autograd.h"
#include "tensor/allocator.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera {
namespace {

constexpr int64_t kBatch = 32, kDim = 64, kHidden = 256, kLayers = 4;
constexpr double kDropout = 0.1;
constexpr uint64_t kSeed = 2024;

struct Layer {
  Tensor ln_w, ln_b, w1, w2;
};

struct Model {
  std::vector<Layer> layers;
  Tensor x, target;

  Model() {
    Generator g(7);
    auto param = [&](const Shape& s, double scale, double shift) {
      Tensor t;
      {
        NoGradGuard no_grad;
        t = randn(s, DType::f32, kCPU, &g) * scale + shift;
      }
      return t.requires_grad_();
    };
    for (int64_t l = 0; l < kLayers; ++l) {
      layers.push_back({param({kDim}, 0.1, 1.0), param({kDim}, 0.1, 0.0),
                        param({kDim, kHidden}, 0.125, 0.0), param({kHidden, kDim}, 0.0625, 0.0)});
    }
    x = param({kBatch, kDim}, 1.0, 0.0);
    NoGradGuard no_grad;
    target = randn({kBatch, kDim}, DType::f32, kCPU, &g);
  }

  std::vector<Tensor> leaves() const {
    std::vector<Tensor> out;
    for (const Layer& p : layers) out.insert(out.end(), {p.ln_w, p.ln_b, p.w1, p.w2});
    out.push_back(x);
    return out;
  }
  void zero_grad() const {
    for (const Tensor& t : leaves()) t.set_grad(Tensor());
  }
};

Tensor block(const Layer& p, const Tensor& h) {
  const Tensor a = matmul(layer_norm(h, {kDim}, p.ln_w, p.ln_b), p.w1);
  return h + matmul(dropout(gelu(a), kDropout), p.w2);
}

Tensor checkpointed_block(const Layer& p, const Tensor& h) {
  // The parameters are captured leaves; only the block input is passed.
  return autograd::checkpoint(
      [&p](const std::vector<Tensor>& in) { return std::vector<Tensor>{block(p, in[0])}; }, {h})[0];
}

enum class Mode { plain, checkpoint, nested };

// Runs the forward from a fixed generator state, crediting its allocations to `tracker`
// (if given; it must outlive every tensor allocated here, the graph's included).
// `data_input`: the first block's input is data (does not require grad), so only the
// parameters' gradients flow.
Tensor forward(const Model& m, Mode mode, MemoryTracker* tracker = nullptr,
               bool data_input = false) {
  Tensor loss;
  {
    MemoryScope scope(tracker);
    manual_seed(kSeed);
    Tensor h = data_input ? m.x.detach() : m.x;
    if (mode == Mode::nested) {
      // Outer checkpoints over pairs of layers, each layer checkpointed again inside.
      for (int64_t l = 0; l < kLayers; l += 2) {
        const Layer *p0 = &m.layers[l], *p1 = &m.layers[l + 1];
        h = autograd::checkpoint(
            [p0, p1](const std::vector<Tensor>& in) {
              return std::vector<Tensor>{checkpointed_block(*p1, checkpointed_block(*p0, in[0]))};
            },
            {h})[0];
      }
    } else {
      for (const Layer& p : m.layers) {
        h = mode == Mode::plain ? block(p, h) : checkpointed_block(p, h);
      }
    }
    loss = sum(h * m.target);
  }
  return loss;
}

// The bit patterns of t's values (empty for an undefined tensor).
std::vector<uint32_t> bits(const Tensor& t) {
  std::vector<uint32_t> out;
  if (!t.defined()) return out;
  for (float v : t.to_vector<float>()) out.push_back(std::bit_cast<uint32_t>(v));
  return out;
}

struct Result {
  std::vector<uint32_t> loss;
  std::vector<std::vector<uint32_t>> grads;  // per leaf, Model::leaves() order
};

Result run(const Model& m, Mode mode, int backward_passes = 1, bool data_input = false) {
  m.zero_grad();
  Tensor loss = forward(m, mode, nullptr, data_input);
  for (int i = 0; i < backward_passes; ++i) {
    loss.backward(Tensor(), /*retain_graph=*/i + 1 < backward_passes);
  }
  Result r{bits(loss), {}};
  for (const Tensor& t : m.leaves()) r.grads.push_back(bits(t.grad()));
  return r;
}

void check_same(const Result& a, const Result& b) {
  CHECK(a.loss == b.loss);
  REQUIRE(a.grads.size() == b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    CAPTURE(i);
    CHECK(a.grads[i] == b.grads[i]);
    if (i + 1 < a.grads.size()) CHECK_FALSE(a.grads[i].empty());  // every parameter got one
  }
}

std::set<std::string> node_names(const Tensor& out) {
  std::set<std::string> names;
  std::vector<autograd::Node*> stack = {out.grad_fn().get()};
  std::set<autograd::Node*> seen;
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (n == nullptr || !seen.insert(n).second) continue;
    names.insert(n->name());
    for (const autograd::Edge& e : n->next_edges()) stack.push_back(e.fn.get());
  }
  return names;
}

TEST_CASE("the plain run is a meaningful reference: dropout draws from the generator") {
  const Model m;
  const Result a = run(m, Mode::plain), again = run(m, Mode::plain);
  check_same(a, again);  // deterministic from the seed
  // Another seed drops other units: loss and gradients change, so matching masks matter.
  m.zero_grad();
  manual_seed(kSeed + 1);
  Tensor h = m.x;
  for (const Layer& p : m.layers) h = block(p, h);
  Tensor other = sum(h * m.target);
  CHECK(bits(other) != a.loss);
  // The dropout really zeroes about kDropout of the units.
  manual_seed(kSeed);
  NoGradGuard no_grad;
  const std::vector<float> d = dropout(ones({kBatch, kHidden}), kDropout).to_vector<float>();
  int64_t zeros_seen = 0;
  for (float v : d) {
    zeros_seen += v == 0.0f;
    CHECK((v == 0.0f || v == static_cast<float>(1.0 / (1.0 - kDropout))));
  }
  CHECK(zeros_seen > kBatch * kHidden * kDropout * 0.8);
  CHECK(zeros_seen < kBatch * kHidden * kDropout * 1.2);
}

TEST_CASE("checkpointing gives bitwise the same loss and gradients") {
  const Model m;
  const Result plain = run(m, Mode::plain);

  SUBCASE("one checkpoint per layer") {
    check_same(plain, run(m, Mode::checkpoint));
    // The graph holds checkpoint nodes instead of the layers' ops.
    m.zero_grad();
    const std::set<std::string> names = node_names(forward(m, Mode::checkpoint));
    CHECK(names.count("checkpoint") == 1);
    CHECK(names.count("gelu") == 0);
    CHECK(names.count("layer_norm") == 0);
    CHECK(node_names(forward(m, Mode::plain)).count("gelu") == 1);
  }
  SUBCASE("nested checkpoints") {
    check_same(plain, run(m, Mode::nested));
  }
  SUBCASE("a data input that does not require grad") {
    const Result data_plain = run(m, Mode::plain, 1, /*data_input=*/true);
    CHECK(data_plain.grads.back().empty());  // x got no gradient
    check_same(data_plain, run(m, Mode::checkpoint, 1, true));
    check_same(data_plain, run(m, Mode::nested, 1, true));
    for (size_t i = 0; i + 1 < plain.grads.size(); ++i)
      CHECK(data_plain.grads[i] == plain.grads[i]);
  }
  SUBCASE("the forward's batch slice is replayed when backward runs outside it") {
    // A pipeline runs a micro-batch's forward inside its BatchSliceScope and its backward
    // later, outside: the recomputation must draw the same rows of the masks. The rows drawn
    // (the first kBatch of a batch of 4 kBatch, starting at row kBatch) differ from the
    // plain run's, so the sliced plain run is the reference.
    auto sliced = [&](Mode mode) {
      m.zero_grad();
      Tensor loss;
      {
        const BatchSliceScope slice({4 * kBatch, kBatch, kBatch});
        loss = forward(m, mode);
      }
      loss.backward();
      Result r{bits(loss), {}};
      for (const Tensor& t : m.leaves()) r.grads.push_back(bits(t.grad()));
      return r;
    };
    const Result plain_sliced = sliced(Mode::plain);
    CHECK(plain_sliced.loss != plain.loss);
    check_same(plain_sliced, sliced(Mode::checkpoint));
    check_same(plain_sliced, sliced(Mode::nested));
  }
  SUBCASE("the generator is left where the forward left it") {
    m.zero_grad();
    Tensor loss = forward(m, Mode::checkpoint);
    const uint64_t offset = default_generator().offset();
    CHECK(offset == static_cast<uint64_t>(kLayers * kBatch * kHidden));  // one mask per layer
    loss.backward();
    CHECK(default_generator().offset() == offset);
    CHECK(default_generator().seed() == kSeed);
  }
}

TEST_CASE("checkpointing honours retain_graph") {
  const Model m;
  const Result plain = run(m, Mode::plain);
  for (Mode mode : {Mode::checkpoint, Mode::nested}) {
    CAPTURE(static_cast<int>(mode));
    // Two passes over a retained graph recompute twice and accumulate exactly 2x.
    const Result twice = run(m, mode, 2);
    CHECK(twice.loss == plain.loss);
    const std::vector<Tensor> leaves = m.leaves();
    for (size_t i = 0; i < leaves.size(); ++i) {
      CAPTURE(i);
      std::vector<uint32_t> doubled;
      for (uint32_t b : plain.grads[i])
        doubled.push_back(std::bit_cast<uint32_t>(2.0f * std::bit_cast<float>(b)));
      CHECK(twice.grads[i] == doubled);
    }
    // Without retain_graph the saved block inputs are freed: a second pass is an Error.
    m.zero_grad();
    Tensor loss = forward(m, mode);
    loss.backward();
    CHECK_THROWS_AS(loss.backward(), Error);
  }
}

TEST_CASE("checkpointing keeps only the block inputs alive after the forward") {
  const Model m;
  // Bytes allocated during the forward and still alive after it: what the graph keeps for
  // backward, plus the block outputs and the loss. After backward everything is returned.
  auto held_after_forward = [&m](Mode mode) {
    MemoryTracker tracker;  // outlives `loss` and the graph behind it
    m.zero_grad();
    Tensor loss = forward(m, mode, &tracker);
    const int64_t held = tracker.current();
    loss.backward();
    loss = Tensor();
    CHECK(tracker.current() == 0);
    CHECK(tracker.peak() >= held);
    return held;
  };
  const int64_t plain = held_after_forward(Mode::plain);
  const int64_t checkpointed = held_after_forward(Mode::checkpoint);
  const int64_t nested = held_after_forward(Mode::nested);
  constexpr int64_t f32 = 4, loss_bytes = f32;
  // Checkpointed: each block's output [B, D] (the next block's saved input) and the loss.
  const int64_t block_outputs = kLayers * kBatch * kDim * f32;
  // Plain, per layer, what backward reads: the layer_norm output [B, D] (matmul's input),
  // its mean and rstd [B], the first matmul's output [B, H] (gelu's input), the dropout
  // output [B, H] (second matmul's input), and the block output [B, D].
  const int64_t per_layer = (2 * kBatch * kDim + 2 * kBatch * kHidden + 2 * kBatch) * f32;
  MESSAGE("live bytes after the forward: plain ", plain, ", checkpointed ", checkpointed,
          ", nested ", nested);
  CHECK(plain == kLayers * per_layer + loss_bytes);
  CHECK(checkpointed == block_outputs + loss_bytes);
  CHECK(nested == block_outputs / 2 + loss_bytes);  // only the outer blocks' outputs
  CHECK(plain > 9 * checkpointed);
}

}  // namespace
}  // namespace tessera
