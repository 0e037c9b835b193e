// The threads backend: the shared collective checks on 2, 3, 4 and 8 ranks, plus what only
// this backend promises (failure propagation, timeouts, bitwise equal results, kernel
// threads per rank, progress without wait()).
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/parallel.h"
#include "parallel/comm/threads.h"
#include "tensor/error.h"
#include "tests/parallel/collective_checks.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using tessera::testing::contains;
using tessera::testing::error_of;

TEST_CASE("threads: every collective on 2, 3, 4 and 8 ranks") {
  for (int n : {2, 3, 4, 8}) {
    CAPTURE(n);
    run_threads(n, [](CommPtr world) { testing::check_collectives(world); });
  }
}

TEST_CASE("threads: a single rank is a group of one") {
  run_threads(1, [](CommPtr world) {
    CHECK(world->size() == 1);
    Tensor t = Tensor::from_vector<float>({1.5f, -2.f}, {2});
    world->all_reduce(t, ReduceOp::avg);
    CHECK(t.to_vector<float>() == std::vector<float>{1.5f, -2.f});
    testing::check_collectives(world);
  });
}

TEST_CASE("threads: ranks, names and backend") {
  std::vector<int> seen(3, -1);
  run_threads(3, [&](CommPtr world) {
    CHECK(world->size() == 3);
    CHECK(world->name() == "world");
    CHECK(world->backend() == "threads");
    seen[world->rank()] = world->rank();
  });
  CHECK(seen == std::vector<int>{0, 1, 2});
  CHECK_THROWS_AS(run_threads(0, [](CommPtr) {}), Error);
}

TEST_CASE("threads: an exception in one rank reaches the others and run_threads") {
  std::vector<std::string> messages(3);
  auto body = [&](CommPtr world) {
    if (world->rank() == 1) throw Error("boom in rank 1");
    try {
      world->all_reduce(Tensor::from_vector<float>({1.f}, {1}), ReduceOp::sum);
    } catch (const Error& e) {
      messages[world->rank()] = e.what();
      throw;  // run_threads must still report the root cause, not this consequence
    }
  };
  const std::string thrown = error_of([&] { run_threads(3, body); });
  CHECK(thrown == "boom in rank 1");
  for (int r : {0, 2}) {
    CAPTURE(messages[r]);
    CHECK(contains(messages[r], "all_reduce on group 'world'"));
    CHECK(contains(messages[r], "rank 1 failed: boom in rank 1"));
  }
  // Exceptions other than Error keep their type; later collectives fail at once.
  std::atomic<int> later_failures{0};
  CHECK_THROWS_AS(run_threads(2,
                              [&](CommPtr world) {
                                if (world->rank() == 0) throw std::runtime_error("plain");
                                for (int i = 0; i < 3; ++i) {
                                  if (contains(error_of([&] { world->barrier(); }),
                                               "rank 0 failed: plain")) {
                                    ++later_failures;
                                  }
                                }
                              }),
                  std::runtime_error);
  CHECK(later_failures == 3);
}

TEST_CASE("threads: a rank that returns early does not hang the others") {
  std::vector<std::string> messages(3);
  run_threads(3, [&](CommPtr world) {
    if (world->rank() == 1) return;
    messages[world->rank()] = error_of([&] {
      world->all_reduce(Tensor::from_vector<float>({1.f}, {1}), ReduceOp::sum);
    });
  });
  for (int r : {0, 2}) {
    CAPTURE(messages[r]);
    CHECK(contains(messages[r], "rank 1 exited before joining all_reduce on group 'world'"));
  }
  std::string recv_error;
  run_threads(2, [&](CommPtr world) {
    if (world->rank() == 1) return;
    recv_error = error_of([&] { world->recv(Tensor::empty({2}), 1, 3); });
  });
  CHECK(contains(recv_error, "rank 1 exited before sending the message with tag 3"));
}

TEST_CASE("threads: a rank whose thread cannot start is an Error, and the others stop") {
  // In a child process with its address space capped just above what it uses: each rank's
  // thread needs a stack mapping, and some of 64 cannot get one (as under a memory limit or
  // a thread limit). Root ignores thread-count limits, so the address space is the lever.
  const pid_t pid = fork();
  if (pid == 0) {
    long pages = 0;
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    if (f == nullptr || std::fscanf(f, "%ld", &pages) != 1) _exit(2);
    std::fclose(f);
    const rlim_t used = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
    const struct rlimit cap = {used + (rlim_t{96} << 20), used + (rlim_t{96} << 20)};
    if (setrlimit(RLIMIT_AS, &cap) != 0) _exit(3);
    try {
      run_threads(64, [](CommPtr world) { world->barrier(); });
    } catch (const Error& e) {
      _exit(contains(e.what(), "run_threads: cannot start the thread of rank") ? 0 : 4);
    } catch (...) {
      _exit(5);
    }
    _exit(6);  // every thread started: the cap was not low enough to test anything
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("threads: a collective waiting past the timeout throws") {
  std::promise<void> timed_out;
  std::string first, second;
  ThreadsOptions options;
  options.timeout_seconds = 0.5;
  run_threads(
      2,
      [&](CommPtr world) {
        if (world->rank() == 0) {
          first = error_of([&] { world->barrier(); });
          timed_out.set_value();
        } else {
          timed_out.get_future().wait();  // arrive only after rank 0 gave up
          second = error_of([&] { world->barrier(); });
        }
      },
      options);
  CAPTURE(first);
  CAPTURE(second);
  CHECK(contains(first, "barrier on group 'world': timed out after 0.5 s; rank 1 never arrived"));
  CHECK(contains(second, "unusable after an earlier failure"));
  std::string recv_error;
  run_threads(
      2,
      [&](CommPtr world) {
        if (world->rank() == 0) recv_error = error_of([&] { world->recv(Tensor::empty({1}), 1); });
      },
      options);
  // Rank 1 may have exited before or after the deadline; either way rank 0 must not hang.
  CHECK((contains(recv_error, "timed out after 0.5 s") || contains(recv_error, "exited")));
}

TEST_CASE("threads: reductions give bitwise equal results in member order") {
  constexpr int kRanks = 3;
  constexpr int64_t kLen = 10007;
  // Values whose sums round: a different order would change low bits.
  auto input = [](int rank, int64_t i) {
    return static_cast<float>(std::sin(0.37 * i + rank) * std::pow(10.0, rank - 1));
  };
  std::vector<std::vector<float>> sums(kRanks), avgs(kRanks);
  std::vector<std::vector<double>> halves(kRanks);
  run_threads(kRanks, [&](CommPtr world) {
    std::vector<float> mine(kLen);
    for (int64_t i = 0; i < kLen; ++i) mine[i] = input(world->rank(), i);
    Tensor s = Tensor::from_vector(mine, {kLen});
    Tensor a = s.clone();
    Tensor h = s.cast(DType::f16);
    world->all_reduce(s, ReduceOp::sum);
    world->all_reduce_async(a, ReduceOp::avg)->wait();
    world->all_reduce(h, ReduceOp::sum);
    sums[world->rank()] = s.to_vector<float>();
    avgs[world->rank()] = a.to_vector<float>();
    halves[world->rank()] = h.to_vector<double>();
  });
  for (int r = 1; r < kRanks; ++r) {
    CHECK(std::memcmp(sums[r].data(), sums[0].data(), kLen * sizeof(float)) == 0);
    CHECK(std::memcmp(avgs[r].data(), avgs[0].data(), kLen * sizeof(float)) == 0);
    CHECK(halves[r] == halves[0]);
  }
  // ((x0 + x1) + x2) in f32; f16 sums in f32 from the f16 inputs and rounds once.
  int64_t wrong_sum = 0, wrong_avg = 0, wrong_half = 0;
  for (int64_t i = 0; i < kLen; ++i) {
    const float sum = (input(0, i) + input(1, i)) + input(2, i);
    wrong_sum += sums[0][i] != sum;
    wrong_avg += avgs[0][i] != sum / 3.f;
    float half_sum = 0;
    for (int r = 0; r < kRanks; ++r) half_sum += static_cast<float>(Half(input(r, i)));
    wrong_half += halves[0][i] != static_cast<double>(static_cast<float>(Half(half_sum)));
  }
  CHECK(wrong_sum == 0);
  CHECK(wrong_avg == 0);
  CHECK(wrong_half == 0);
}

TEST_CASE("threads: kernel threads per rank") {
  std::vector<int> threads(2, 0);
  ThreadsOptions options;
  options.kernel_threads = 3;
  run_threads(2, [&](CommPtr world) { threads[world->rank()] = cpu::num_threads(); }, options);
  CHECK(threads == std::vector<int>{3, 3});
  const int expected = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 4);
  std::vector<int> defaults(4, 0);
  run_threads(4, [&](CommPtr world) { defaults[world->rank()] = cpu::num_threads(); });
  CHECK(defaults == std::vector<int>(4, expected));
}

TEST_CASE("threads: async collectives progress without wait()") {
  constexpr int64_t kLen = 1 << 21;
  std::vector<int> polled(2, 0);
  run_threads(2, [&](CommPtr world) {
    Tensor t = Tensor::from_vector(std::vector<float>(kLen, 1.f + world->rank()), {kLen});
    WorkHandle h = world->all_reduce_async(t, ReduceOp::sum);
    // Only the worker thread can complete it: nobody calls wait() until it reports completion.
    for (int i = 0; i < 60000 && !h->is_completed(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++polled[world->rank()];
    }
    REQUIRE(h->is_completed());
    h->wait();
    h->wait();  // a second wait returns at once
    const std::vector<float> v = t.to_vector<float>();
    CHECK(std::count(v.begin(), v.end(), 3.f) == kLen);
  });
  CHECK(polled[0] < 60000);
}

TEST_CASE("threads: unwaited operations finish before their rank counts as exited") {
  std::vector<float> got(2, 0);
  run_threads(2, [&](CommPtr world) {
    Tensor t = Tensor::from_vector<float>({1.f + world->rank()}, {1});
    if (world->rank() == 0) {
      world->all_reduce_async(t, ReduceOp::sum);  // never waited
      return;
    }
    world->all_reduce(t, ReduceOp::sum);
    got[1] = t.item<float>();
  });
  CHECK(got[1] == 3.f);
}

TEST_CASE("threads: mismatched collectives and messages throw instead of hanging") {
  std::vector<std::string> messages(2);
  run_threads(2, [&](CommPtr world) {
    Tensor t = Tensor::from_vector<float>({1.f, 2.f}, {2});
    messages[world->rank()] = error_of([&] {
      if (world->rank() == 0) world->all_reduce(t, ReduceOp::sum);
      else world->broadcast(t, 0);
    });
  });
  for (const std::string& m : messages) {
    CAPTURE(m);
    CHECK(contains(m, "members disagree on the collective: rank 0 has all_reduce but rank 1 has "
                      "broadcast"));
  }
  std::vector<std::string> sizes(2);
  run_threads(2, [&](CommPtr world) {
    Tensor t = Tensor::from_vector<float>(std::vector<float>(2 + world->rank(), 1.f),
                                          {2 + world->rank()});
    sizes[world->rank()] = error_of([&] { world->all_reduce(t, ReduceOp::sum); });
  });
  for (const std::string& m : sizes) {
    CHECK(contains(m, "element count: rank 0 has 2 but rank 1 has 3"));
  }
  std::string recv_error;
  run_threads(2, [&](CommPtr world) {
    if (world->rank() == 0) world->send(Tensor::from_vector<int32_t>({1, 2, 3}, {3}), 1, 4);
    else recv_error = error_of([&] { world->recv(Tensor::empty({2}, DType::i32), 0, 4); });
  });
  CHECK(contains(recv_error,
                 "expects 2 i32 elements from rank 0 (tag 4) but the message holds 3 i32"));
}

TEST_CASE("threads: communicators cannot be used after run_threads returned") {
  CommPtr kept, sub;
  run_threads(2, [&](CommPtr world) {
    CommPtr s = world->split(0, world->rank(), "pair");
    if (world->rank() == 0) {
      kept = world;
      sub = s;
    }
  });
  REQUIRE(kept);
  CHECK(sub->size() == 2);
  CHECK(contains(error_of([&] { kept->barrier(); }), "used after its rank finished"));
  CHECK(contains(error_of([&] { sub->all_reduce(Tensor::empty({1}), ReduceOp::sum); }),
                 "used after its rank finished"));
}

}  // namespace
}  // namespace tessera::parallel
