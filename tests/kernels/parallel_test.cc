// The CPU thread pool (kernels/cpu/parallel.h): parallel_parts runs every part exactly once
// whatever the thread count and the part count; the first exception of a part reaches the
// caller and the pool stays usable; calls from inside a part run inline on one thread;
// parallel_for's chunks are the documented ones; several caller threads, each with its own
// pool, run jobs at once; a lower thread count after a higher one runs that many threads; a
// forked child runs jobs without its parent's workers. Also the vectorised elementwise paths
// whose bits must not depend on where a thread's chunk starts (gelu's backward, 16-bit
// transcendental ops).
// Built twice (tests/kernels/BUILD): TESSERA_SPIN_US=50 and 0 (workers sleep after every job,
// so each job must wake them: a lost wake-up shows as a hang, which the test's timeout ends).
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace tessera {
namespace {

struct ThreadCount {
  int saved = cpu::num_threads();
  explicit ThreadCount(int n) { cpu::set_num_threads(n); }
  ~ThreadCount() { cpu::set_num_threads(saved); }
};

TEST_CASE("the spin setting is the one this binary was built to test") {
  const char* spin = std::getenv("TESSERA_SPIN_US");
  REQUIRE(spin != nullptr);
  MESSAGE("TESSERA_SPIN_US=", spin);
}

TEST_CASE("parallel_parts: every part exactly once, for 1-4 threads and 1-40 parts") {
  for (int threads = 1; threads <= 4; ++threads) {
    ThreadCount tc(threads);
    for (int parts = 1; parts <= 40; ++parts) {
      std::vector<std::atomic<int>> hits(parts);
      for (int rep = 0; rep < 20; ++rep) {
        cpu::parallel_parts(parts, [&](int p) { hits[p].fetch_add(1); });
      }
      int wrong = 0;
      for (int p = 0; p < parts; ++p) wrong += hits[p].load() != 20;
      CAPTURE(threads);
      CAPTURE(parts);
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("parallel_parts: many short jobs in a row (wake-ups are not lost)") {
  ThreadCount tc(2);
  int64_t total = 0;
  std::atomic<int64_t> sum{0};
  for (int job = 0; job < 20000; ++job) {
    cpu::parallel_parts(2, [&](int p) { sum.fetch_add(job * 2 + p); });
    total += job * 2 + (job * 2 + 1);
  }
  CHECK(sum.load() == total);
}

TEST_CASE("parallel_for: the chunks are the range split in num_threads() equal pieces") {
  ThreadCount tc(3);
  std::vector<std::pair<int64_t, int64_t>> chunks(3, {-1, -1});
  cpu::parallel_for(10, 110, 1, [&](int64_t b, int64_t e) {
    const int64_t i = (b - 10) / 34;
    chunks[i] = {b, e};
  });
  CHECK(chunks == std::vector<std::pair<int64_t, int64_t>>{{10, 44}, {44, 78}, {78, 110}});
  // Below the grain: one chunk, on the caller.
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran;
  int calls = 0;
  cpu::parallel_for(0, 100, 1000, [&](int64_t b, int64_t e) {
    ran = std::this_thread::get_id();
    ++calls;
    CHECK(b == 0);
    CHECK(e == 100);
  });
  CHECK(calls == 1);
  CHECK(ran == caller);
}

TEST_CASE("an exception in a part reaches the caller; the pool still runs the next job") {
  ThreadCount tc(2);
  for (int rep = 0; rep < 50; ++rep) {
    std::atomic<int> ran{0};
    try {
      cpu::parallel_parts(4, [&](int p) {
        ran.fetch_add(1);
        if (p == 2) throw std::runtime_error("part 2 failed");
      });
      FAIL("no exception");
    } catch (const std::runtime_error& e) {
      CHECK(std::string(e.what()) == "part 2 failed");
    }
    CHECK(ran.load() == 4);  // the other parts still ran
    std::atomic<int> after{0};
    cpu::parallel_parts(3, [&](int) { after.fetch_add(1); });
    CHECK(after.load() == 3);
  }
}

TEST_CASE("inside a part: one thread, nested calls run inline") {
  ThreadCount tc(2);
  std::vector<int> inner_threads(2, 0), inner_sum(2, 0);
  std::vector<std::thread::id> part_thread(2), nested_thread(2);
  cpu::parallel_parts(2, [&](int p) {
    inner_threads[p] = cpu::num_threads();
    part_thread[p] = std::this_thread::get_id();
    cpu::parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) {
      nested_thread[p] = std::this_thread::get_id();
      inner_sum[p] += static_cast<int>(e - b);
    });
  });
  CHECK(inner_threads == std::vector<int>{1, 1});
  CHECK(inner_sum == std::vector<int>{1000, 1000});
  CHECK(nested_thread == part_thread);
  CHECK(cpu::num_threads() == 2);  // restored on the caller
}

TEST_CASE("several caller threads run jobs at once, each on its own pool") {
  constexpr int kCallers = 4, kJobs = 2000;
  std::vector<int64_t> sums(kCallers, 0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      cpu::set_num_threads(3);
      for (int j = 0; j < kJobs; ++j) {
        std::atomic<int64_t> s{0};
        cpu::parallel_parts(3, [&](int p) { s.fetch_add(p + 1); });
        sums[c] += s.load();
      }
    });  // the thread's pool and its workers end with it
  }
  for (std::thread& t : callers) t.join();
  CHECK(sums == std::vector<int64_t>(kCallers, int64_t{6} * kJobs));
}

TEST_CASE("a lower thread count after a higher one: only that many threads run a job") {
  ThreadCount tc(4);
  cpu::parallel_parts(4, [](int) {});  // the pool now has 3 workers
  cpu::set_num_threads(2);
  for (int rep = 0; rep < 200; ++rep) {
    std::mutex mu;
    std::set<std::thread::id> ran;
    std::atomic<int> hits{0};
    cpu::parallel_for(0, 1 << 20, 1, [&](int64_t, int64_t) {
      hits.fetch_add(1);
      std::lock_guard<std::mutex> lock(mu);
      ran.insert(std::this_thread::get_id());
    });
    CHECK(hits.load() == 2);
    CHECK(ran.size() <= 2);
  }
}

TEST_CASE("an lvalue callable; several throwing parts give one of their errors") {
  ThreadCount tc(3);
  std::atomic<int> n{0};
  auto count = [&](int) { n.fetch_add(1); };
  cpu::parallel_parts(5, count);
  CHECK(n.load() == 5);
  try {
    cpu::parallel_parts(6, [](int p) {
      if (p % 2 == 1) throw std::runtime_error("part " + std::to_string(p));
    });
    FAIL("no exception");
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    CHECK((what == "part 1" || what == "part 3" || what == "part 5"));
  }
}

TEST_CASE("a forked child runs jobs without its parent's workers") {
  ThreadCount tc(2);
  std::atomic<int> warm{0};
  cpu::parallel_parts(2, [&](int) { warm.fetch_add(1); });  // the parent's pool has a worker
  REQUIRE(warm.load() == 2);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::atomic<int> hits{0};
    for (int rep = 0; rep < 100; ++rep) cpu::parallel_parts(2, [&](int) { hits.fetch_add(1); });
    _exit(hits.load() == 200 ? 0 : 1);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

// gelu's backward is vectorised in packets (kernels/cpu/elementwise.cc): each element must
// take the same path wherever its thread's chunk starts and however its buffer is aligned.
TEST_CASE("vectorised gelu backward: the same bits at any offset and on 1 or 2 threads") {
  const int64_t n = 100003;  // odd: chunks of two threads start mid-packet
  const Tensor x = randn({n + 7}), g = randn({n + 7});
  for (bool tanh_form : {true, false}) {
    CAPTURE(tanh_form);
    std::vector<float> ref;
    {
      ThreadCount tc(1);
      ref = gelu_backward(g, x, tanh_form).to_vector<float>();
    }
    ThreadCount tc(2);
    const std::vector<float> two = gelu_backward(g, x, tanh_form).to_vector<float>();
    CHECK(std::memcmp(two.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    for (int64_t off : {1, 3, 7}) {
      CAPTURE(off);
      const std::vector<float> shifted =
          gelu_backward(g.narrow(0, off, n), x.narrow(0, off, n), tanh_form).to_vector<float>();
      CHECK(std::memcmp(shifted.data(), ref.data() + off, n * sizeof(float)) == 0);
    }
  }
}

// f16/bf16 transcendental ops on contiguous runs are widened a block at a time, evaluated on
// the f32 vectorised path and rounded once (kernels/cpu/elementwise.cc): each element is the
// f32 op's result on the widened input, rounded, wherever its thread's run starts and on 1 or
// 2 threads. n is odd, past the elementwise grain (2^15: two threads split the run) and spans
// many of the 256-element blocks; offsets shift every block.
TEST_CASE("16-bit transcendental ops: the f32 op's bits rounded once, at any offset and on 1 or 2 threads") {
  const int64_t n = 100003;
  const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&, const Tensor&)>>> ops = {
      {"gelu", [](const Tensor& x, const Tensor&) { return gelu(x); }},
      {"gelu tanh", [](const Tensor& x, const Tensor&) { return gelu(x, true); }},
      {"tanh", [](const Tensor& x, const Tensor&) { return tanh(x); }},
      {"exp", [](const Tensor& x, const Tensor&) { return exp(x); }},
      {"sigmoid", [](const Tensor& x, const Tensor&) { return sigmoid(x); }},
      {"gelu_backward", [](const Tensor& x, const Tensor& g) { return gelu_backward(g, x); }},
      {"gelu_backward tanh", [](const Tensor& x, const Tensor& g) { return gelu_backward(g, x, true); }},
  };
  int checked = 0;
  for (DType dt : {DType::bf16, DType::f16}) {
    // Wide enough that gelu_backward's tanh form meets u < -2 (its scalar lanes).
    const Tensor x = (randn({n + 7}) * 2.5).cast(dt), g = randn({n + 7}).cast(dt);
    for (const auto& [name, op] : ops) {
      const std::string label = std::string(name) + " " + std::string(dtype_name(dt));
      CAPTURE(label);
      const std::vector<float> want = op(x.cast(DType::f32), g.cast(DType::f32)).cast(dt).to_vector<float>();
      for (int threads : {1, 2}) {
        ThreadCount tc(threads);
        const std::vector<float> got = op(x, g).to_vector<float>();
        CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
        for (int64_t off : {1, 3, 7}) {
          const std::vector<float> shifted = op(x.narrow(0, off, n), g.narrow(0, off, n)).to_vector<float>();
          CHECK(std::memcmp(shifted.data(), want.data() + off, n * sizeof(float)) == 0);
        }
      }
      ++checked;
    }
  }
  CHECK(checked == 14);
}

// Where u = sqrt(2/pi) (x + 0.044715 x^3) < -2, 1 + tanh(u) cancels, so the vectorised
// tanh-form backward gives those lanes the scalar functor (as CUDA does): bitwise what a
// strided run (the scalar loop) gives. Each 16-lane packet holds one such lane, at every
// position in turn (x from -2.5 down to -6: u(-2.5) = -2.55), among lanes before the cut
// (x in [-2, 3): u(-2) = -1.88), so a packet's scan that missed a lane would show.
TEST_CASE("gelu backward (tanh form): past u = -2 the vectorised path gives the scalar functor's bits") {
  constexpr int64_t kPackets = 64, n = 16 * kPackets;
  std::vector<float> xs(n), gs(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t packet = i / 16, lane = i % 16;
    xs[i] = lane == packet % 16 ? -2.5f - 3.5f * static_cast<float>(packet) / kPackets
                                : -2.0f + 5.0f * static_cast<float>((i * 379) % n) / static_cast<float>(n);
    gs[i] = 1.0f + 0.25f * static_cast<float>(i % 7);
  }
  const Tensor x = Tensor::from_vector<float>(xs, {n}), g = Tensor::from_vector<float>(gs, {n});
  // The same values every other element of a [n, 2] buffer: a run of stride 2, the scalar loop.
  const Tensor x2 = stack({x, x}, 1).select(1, 0), g2 = stack({g, g}, 1).select(1, 0);
  REQUIRE(x2.strides()[0] == 2);
  const std::vector<float> packed = gelu_backward(g, x, true).to_vector<float>();
  const std::vector<float> scalar = gelu_backward(g2, x2, true).to_vector<float>();
  int64_t tail = 0, tail_equal = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (xs[i] > -2.5f) continue;
    ++tail;
    tail_equal += std::memcmp(&packed[i], &scalar[i], sizeof(float)) == 0;
  }
  CHECK(tail == kPackets);
  CHECK(tail_equal == tail);
}

// A NaN in the same packet (or 256-element block) as a lane past u = -2 must not hide it:
// a minimum that lets the NaN swallow the lower value would skip the lane's scalar path.
TEST_CASE("gelu backward (tanh form): a NaN lane does not hide a lane past u = -2") {
  constexpr int64_t kPackets = 64, n = 16 * kPackets;
  std::vector<float> xs(n, 0.25f), gs(n, 1.0f);
  for (int64_t p = 0; p < kPackets; ++p) {
    const int64_t below = p % 16, nan = (p + 1 + p / 16) % 16;  // every distance, both orders
    xs[p * 16 + below] = -2.5f - 0.02f * static_cast<float>(p);
    xs[p * 16 + nan] = NAN;
  }
  const Tensor x = Tensor::from_vector<float>(xs, {n}), g = Tensor::from_vector<float>(gs, {n});
  const Tensor x2 = stack({x, x}, 1).select(1, 0), g2 = stack({g, g}, 1).select(1, 0);
  const std::vector<float> packed = gelu_backward(g, x, true).to_vector<float>();
  const std::vector<float> scalar = gelu_backward(g2, x2, true).to_vector<float>();
  int64_t below = 0, below_equal = 0, nans = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(xs[i])) {
      nans += std::isnan(packed[i]) ? 1 : 0;
    } else if (xs[i] < -2.4f) {
      ++below;
      below_equal += std::memcmp(&packed[i], &scalar[i], sizeof(float)) == 0;
    }
  }
  CHECK(below == kPackets);
  CHECK(below_equal == below);
  CHECK(nans == kPackets);
}

// gelu's tanh-form backward at |x| where x^3 overflows f32 but x^2 does not: the derivative
// is 1 (x > 0) or 0 (x < 0), on the vectorised path (a run of 40) and the scalar one (1).
TEST_CASE("gelu backward (tanh form) is 1 or 0 for huge |x|, not NaN") {
  for (int64_t n : {40, 1}) {
    CAPTURE(n);
    for (double v : {1e15, -1e15, 1e18, -1e18}) {
      CAPTURE(v);
      const Tensor x = full({n}, v, DType::f32), g = full({n}, 1.0, DType::f32);
      const std::vector<float> d = gelu_backward(g, x, true).to_vector<float>();
      CHECK(d == std::vector<float>(n, v > 0 ? 1.0f : 0.0f));
    }
  }
}

TEST_CASE("vectorised unary ops: the same bits at any offset and on 1 or 2 threads") {
  const int64_t n = 100003;
  const Tensor x = randn({n + 7});
  const std::pair<const char*, std::function<Tensor(const Tensor&)>> ops[] = {
      {"exp", [](const Tensor& t) { return exp(t); }},
      {"tanh", [](const Tensor& t) { return tanh(t); }},
      {"sigmoid", [](const Tensor& t) { return sigmoid(t); }},
      {"gelu tanh", [](const Tensor& t) { return gelu(t, true); }},
      {"gelu erf", [](const Tensor& t) { return gelu(t, false); }},
  };
  for (const auto& entry : ops) {
    const std::string name = entry.first;  // a plain variable: clang 14 cannot capture a binding
    const std::function<Tensor(const Tensor&)>& op = entry.second;
    CAPTURE(name);
    std::vector<float> ref;
    {
      ThreadCount tc(1);
      ref = op(x).to_vector<float>();
    }
    ThreadCount tc(2);
    const std::vector<float> two = op(x).to_vector<float>();
    CHECK(std::memcmp(two.data(), ref.data(), ref.size() * sizeof(float)) == 0);
    for (int64_t off : {1, 3, 7}) {
      CAPTURE(off);
      const std::vector<float> shifted = op(x.narrow(0, off, n)).to_vector<float>();
      CHECK(std::memcmp(shifted.data(), ref.data() + off, n * sizeof(float)) == 0);
    }
  }
}

}  // namespace
}  // namespace tessera
