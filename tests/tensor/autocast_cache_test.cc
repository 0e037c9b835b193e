// Autocast's cast cache (tensor/autocast.h): a parameter is cast once while a holder is open,
// each reuse has the cast's bits and its own graph node, and the gradients are those of the
// uncached run (AutocastGuard(low, /*cache_casts=*/false), every cast made) bit for bit. An
// in-place write, a closed holder or clear_cast_cache() end an entry; explicit casts,
// activations and other threads never see one. A permuted view of a parameter is cast in its
// storage order (so v and v^T share one entry), with the values and gradients of an explicit
// cast of a contiguous copy.
#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <span>
#include <optional>
#include <thread>
#include <vector>

#include "tensor/allocator.h"
#include "tensor/autocast.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tests/testing.h"

namespace tessera {
namespace {

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.raw_data(), cb.raw_data(), static_cast<size_t>(ca.nbytes())) == 0;
}

CastCacheStats since(const CastCacheStats& before) {
  const CastCacheStats now = cast_cache_stats();
  return {now.hits - before.hits, now.misses - before.misses, now.entries};
}

// Two parameters, one used through a transposed view (as GPT's tied head is) and once as it
// is (linear), over `micro` micro-batches x[m]; returns each micro-batch's output.
struct Model {
  Tensor w = randn({6, 8}).requires_grad_();
  Tensor b = randn({6}).requires_grad_();
  Tensor v = randn({6, 6}).requires_grad_();
  std::vector<Tensor> x;
  explicit Model(int micro) {
    for (int m = 0; m < micro; ++m) x.push_back(randn({4, 8}));
  }
  Tensor forward(const Tensor& xm) const {
    const Tensor h = linear(xm, w, b);           // w and b as they are
    return matmul(h, transpose(v, 0, 1)) + matmul(h, v);  // v twice, once transposed
  }
  void zero() const {
    for (const Tensor& p : {w, b, v}) p.set_grad(Tensor());
  }
};

TEST_CASE("a parameter is cast once per holder; outputs and gradients have the uncached bits") {
  for (const DType low : {DType::bf16, DType::f16}) {
    CAPTURE(low);
    const Model model(1);
    // Uncached, two forwards: each casts x, w, b (linear), v^T and v (h is low already).
    std::vector<Tensor> want;
    int casts_uncached = 0;
    {
      const testing::KernelCalls casts({OpId::cast});
      {
        AutocastGuard amp(low, /*cache_casts=*/false);
        want = {model.forward(model.x[0]), model.forward(model.x[0])};
      }
      (sum(want[0]) + sum(want[1])).backward();
      casts_uncached = casts.count();
    }
    // 2 x 5 forward casts; backward casts each parameter's gradient back to f32, per use.
    CHECK(casts_uncached == 18);
    const Tensor gw = model.w.grad(), gb = model.b.grad(), gv = model.v.grad();
    model.zero();
    std::vector<Tensor> got;
    const CastCacheStats before = cast_cache_stats();
    {
      const testing::KernelCalls casts({OpId::cast});
      {
        AutocastGuard amp(low);
        got.push_back(model.forward(model.x[0]));
        // w, b and v^T each cast once (x too, uncached: not a parameter); v^T is cast in v's
        // storage order (autocast.cc), so v's own use is served by the same entry.
        CHECK(since(before).misses == 3);
        CHECK(since(before).hits == 1);
        CHECK(since(before).entries == 3);
        got.push_back(model.forward(model.x[0]));  // all four served
        CHECK(since(before).hits == 5);
      }
      CHECK(cast_cache_stats().entries == 0);  // emptied with its last holder
      // The gradients flow through the served casts' own nodes as through the made ones.
      (sum(got[0]) + sum(got[1])).backward();
      // The forwards cast x twice and three parameters once; backward's casts are the same 8.
      CHECK(casts.count() == casts_uncached - 5);
    }
    CHECK(same_bits(got[0], want[0]));
    CHECK(same_bits(got[1], want[1]));
    CHECK(same_bits(model.w.grad(), gw));
    CHECK(same_bits(model.b.grad(), gb));
    CHECK(same_bits(model.v.grad(), gv));
  }
}

TEST_CASE("WeightCastCache: micro-batches share the casts; the accumulated gradients are the uncached ones") {
  constexpr int kMicro = 3;
  const Model model(kMicro);
  auto run = [&](bool cache) {
    model.zero();
    std::optional<WeightCastCache> keep;
    if (cache) keep.emplace();
    std::vector<Tensor> outs;
    for (int m = 0; m < kMicro; ++m) {
      Tensor y;
      {
        AutocastGuard amp(DType::bf16, cache);
        y = model.forward(model.x[m]);
      }
      sum(y).backward();
      outs.push_back(y.detach());
    }
    return std::make_pair(outs, std::vector<Tensor>{model.w.grad(), model.b.grad(), model.v.grad()});
  };
  int uncached_casts = 0, cached_casts = 0;
  std::pair<std::vector<Tensor>, std::vector<Tensor>> want, got;
  {
    const testing::KernelCalls casts({OpId::cast});
    want = run(false);
    uncached_casts = casts.count();
  }
  const CastCacheStats before = cast_cache_stats();
  {
    const testing::KernelCalls casts({OpId::cast});
    got = run(true);
    cached_casts = casts.count();
  }
  // w, b and v cast once (v^T and v share v's entry), the rest served.
  CHECK(since(before).misses == 3);
  CHECK(since(before).hits == 1 + 4 * (kMicro - 1));
  CHECK(since(before).entries == 0);
  CHECK(uncached_casts - cached_casts == 1 + 4 * (kMicro - 1));
  for (int m = 0; m < kMicro; ++m) CHECK(same_bits(got.first[m], want.first[m]));
  for (size_t i = 0; i < got.second.size(); ++i) CHECK(same_bits(got.second[i], want.second[i]));
}

TEST_CASE("an in-place write to the parameter, or clear_cast_cache(), ends its entry") {
  Tensor w = randn({5, 3}).requires_grad_();
  const Tensor x = randn({2, 3});
  AutocastGuard amp(DType::bf16);
  const Tensor first = linear(x, w);
  {
    NoGradGuard no_grad;
    w.copy_(randn({5, 3}));  // (an optimizer's fused update bumps the version the same way)
  }
  const CastCacheStats before = cast_cache_stats();
  const Tensor second = linear(x, w);
  CHECK(since(before).misses == 1);
  CHECK(since(before).hits == 0);
  Tensor want;
  {
    AutocastGuard uncached(DType::bf16, false);
    want = linear(x, w);
  }
  CHECK(same_bits(second, want));
  CHECK_FALSE(same_bits(second, first));
  // Writers outside the op path (a collective into the parameter's bytes) clear the cache.
  clear_cast_cache();
  CHECK(cast_cache_stats().entries == 0);
  linear(x, w);
  CHECK(since(before).misses == 2);
}

TEST_CASE("only autocast's casts of parameters are cached, on this thread, while a holder is open") {
  const Tensor w = randn({5, 3}).requires_grad_();
  const Tensor x = randn({2, 3});
  const CastCacheStats before = cast_cache_stats();
  {
    AutocastGuard amp(DType::bf16);
    // An explicit cast runs (and its output is the caller's own, never an alias).
    const Tensor a = cast(w, DType::bf16), b = cast(w, DType::bf16);
    CHECK(a.storage() != b.storage());
    // An activation (no grad) and a computed tensor that requires grad are not parameters.
    linear(x, x * 1.0);
    linear(x, w * 2.0);
    CHECK(since(before).misses == 0);
    CHECK(since(before).entries == 0);
    // A nested guard with the cache off casts every time; so does autocast off.
    {
      AutocastGuard off(DType::bf16, false);
      linear(x, w);
      linear(x, w);
    }
    CHECK(since(before).entries == 0);
    linear(x, w);
    CHECK(since(before).entries == 1);
    // A nested guard closing keeps the outer holder's entries.
    { AutocastGuard inner(DType::bf16); }
    CHECK(since(before).entries == 1);
    // Another thread has its own cache.
    std::thread([&] {
      AutocastGuard amp2(DType::bf16);
      const CastCacheStats there = cast_cache_stats();
      CHECK(there.entries == 0);
      linear(x, w);
      CHECK(cast_cache_stats().misses - there.misses == 1);
    }).join();
    CHECK(since(before).misses == 1);
  }
  // The last holder closed: the next holder starts empty.
  CHECK(cast_cache_stats().entries == 0);
  {
    AutocastGuard amp(DType::bf16);
    linear(x, w);
    CHECK(since(before).misses == 2);
    CHECK(since(before).entries == 1);
  }
}

TEST_CASE("views of a parameter, a swapped storage, a dead parameter, a gathered unit") {
  Tensor w = randn({6, 4}).requires_grad_();
  const Tensor x = randn({3, 4});
  auto uncached = [&](const Tensor& weight) {
    AutocastGuard amp(DType::bf16, false);
    return linear(x, weight);
  };
  AutocastGuard amp(DType::bf16);
  const CastCacheStats before = cast_cache_stats();
  // A row slice (an offset into w's storage) is its own entry, beside w's.
  const Tensor rows = narrow(w, 0, 2, 3);
  const Tensor a = linear(x, w), b = linear(x, rows);
  CHECK(since(before).misses == 2);
  CHECK(since(before).entries == 2);
  CHECK(same_bits(linear(x, w), a));
  CHECK(same_bits(linear(x, rows), b));
  CHECK(since(before).hits == 2);
  CHECK(same_bits(b, uncached(rows)));
  // set_data gives w another storage: a new entry, its values.
  w.set_data(randn({6, 4}));
  const Tensor c = linear(x, w);
  CHECK(since(before).misses == 3);
  CHECK(same_bits(c, uncached(w)));
  CHECK_FALSE(same_bits(c, a));
  // A parameter that dies takes its entry with it at the next cast (the narrow view of the
  // old storage keeps that storage, and its entries, alive).
  {
    const Tensor t = randn({6, 4}).requires_grad_();
    linear(x, t);
  }
  const int64_t with_dead = cast_cache_stats().entries;
  linear(x, rows);  // a hit: nothing put, nothing dropped
  CHECK(cast_cache_stats().entries == with_dead);
  const Tensor u = randn({5, 4}).requires_grad_();
  linear(x, u);  // a put: the dead one goes, u comes
  CHECK(cast_cache_stats().entries == with_dead);
  // ZeRO-3's gathered units (released after each use) are never cached.
  Tensor g;
  {
    MemoryTagScope tag(MemoryTag::gathered);
    g = randn({6, 4});
  }
  g.requires_grad_();
  const int64_t misses = since(before).misses;
  linear(x, g);
  linear(x, g);
  CHECK(since(before).misses == misses);
  CHECK(cast_cache_stats().entries == with_dead);
}

// Records, for every cast kernel started while it lives, whether its input was contiguous.
class CastInputs {
 public:
  CastInputs() : previous_(kernel_observer()) {
    strided() = 0;
    total() = 0;
    set_kernel_observer(&observe);
  }
  ~CastInputs() { set_kernel_observer(previous_); }
  CastInputs(const CastInputs&) = delete;
  CastInputs& operator=(const CastInputs&) = delete;
  static int& strided() {
    static int n = 0;
    return n;
  }
  static int& total() {
    static int n = 0;
    return n;
  }

 private:
  static void observe(OpId op, Device, bool begin, std::span<const Tensor> in) {
    if (!begin || op != OpId::cast) return;
    ++total();
    if (!in[0].is_contiguous()) ++strided();
  }
  KernelObserver previous_;
};

TEST_CASE("autocast casts a permuted view of a parameter in its storage order: a flat cast, "
          "the same values and gradients") {
  struct Case {
    const char* name;
    Shape shape;                                // the parameter's
    std::function<Tensor(const Tensor&)> view;  // the operand taken from it
    Shape x;                                    // the other operand (x @ view)
    bool dense;                                 // the view permutes the whole storage
    // Casts of a strided input in the backward: the gradient of the weight's cast, which
    // arrives in the layout the product's derivative gives it. A weight broadcast against a
    // batch gets its gradient summed into a contiguous tensor, and one multiplied by a 3-D x
    // through the general branch (matmul(a^T, g)) a contiguous one; either is then a
    // permutation of the cast's storage order.
    int strided_backward;
  };
  const std::vector<Case> cases = {
      {"a tied head's transpose", {10, 6}, [](const Tensor& w) { return transpose(w, 0, 1); },
       {4, 6}, true, 0},
      {"q/k/v's [3, C, C] transposed", {3, 5, 6},
       [](const Tensor& w) { return transpose(w, 1, 2); }, {4, 6}, true, 0},
      {"a size-1 dim among the permuted (broadcast)", {1, 7, 6},
       [](const Tensor& w) { return permute(w, {0, 2, 1}); }, {2, 4, 6}, true, 1},
      {"three dims reversed", {3, 5, 6}, [](const Tensor& w) { return permute(w, {2, 1, 0}); },
       {6, 4, 5}, true, 1},
      {"a column slice's transpose (gaps: cast as before)", {10, 8},
       [](const Tensor& w) { return transpose(narrow(w, 1, 2, 6), 0, 1); }, {4, 6}, false, 0},
  };
  int checked = 0;
  for (const DType low : {DType::bf16, DType::f16}) {
    for (const Case& c : cases) {
      CAPTURE(low);
      CAPTURE(c.name);
      const Tensor init = randn(c.shape), x = randn(c.x);
      // The reference: explicit casts of x and of a contiguous copy of the view.
      const Tensor w_ref = init.clone().requires_grad_();
      const Tensor y_ref = matmul(cast(x, low), cast(c.view(w_ref).contiguous(), low));
      const Tensor g = randn(y_ref.shape()).cast(low);
      y_ref.backward(g);
      const Tensor w = init.clone().requires_grad_();
      Tensor y;
      {
        const CastInputs seen;
        {
          AutocastGuard amp(low);
          y = matmul(x, c.view(w));
        }
        // Forward: x and the weight, the weight in storage order when the view is dense.
        CHECK(CastInputs::total() == 2);
        CHECK(CastInputs::strided() == (c.dense ? 0 : 1));
        CastInputs::total() = CastInputs::strided() = 0;
        y.backward(g);
        // Backward: the weight's gradient back to f32.
        CHECK(CastInputs::total() == 1);
        CHECK(CastInputs::strided() == c.strided_backward);
      }
      CHECK(same_bits(y, y_ref));
      REQUIRE(w.grad().defined());
      CHECK(same_bits(w.grad(), w_ref.grad()));
      ++checked;
    }
  }
  CHECK(checked == 10);
  // Ops that copy a strided input to contiguous anyway get the transposing cast as before
  // (one pass): softmax widens a transposed bf16 tensor to f32 in the view's order.
  const Tensor h = randn({5, 7}).cast(DType::bf16);
  const CastInputs seen;
  Tensor p;
  {
    AutocastGuard amp(DType::bf16);
    p = softmax(transpose(h, 0, 1), -1);
  }
  CHECK(CastInputs::total() == 1);
  CHECK(CastInputs::strided() == 1);
  CHECK(same_bits(p, softmax(transpose(h, 0, 1).contiguous().cast(DType::f32), -1)));
}

}  // namespace
}  // namespace tessera
