// Offload (parallel/offload.h, ZeroOptions::offload): the swap file's engine on its own, then
// ZeRO training with the optimizer (and, at stage 3, the parameters) on the host tier and on
// the file tier against the same training in memory: bitwise the same losses and
// parameters, the device under a budget the in-memory run exceeds, the swap file's bytes per
// step equal to the layout's formula, resume, and the errors; a head too big for the budget
// trained as tiles (nn::TiledLinear).
#include <doctest/doctest.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "nn/layers.h"
#include "parallel/comm/threads.h"
#include "parallel/offload.h"
#include "parallel/zero.h"
#include "tensor/allocator.h"
#include "tests/parallel/dp_harness.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using namespace testing_dp;
using testing::contains;
using testing::error_of;

constexpr int64_t kOffloadSteps = 10;

std::string scratch_dir() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

// ---- the swap file ----------------------------------------------------------------------

std::vector<char> pattern(int64_t n, int seed) {
  std::vector<char> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<char>((i * 131 + seed * 7) % 251);
  return v;
}

TEST_CASE("offload: the swap file writes and reads records back, direct and buffered, and "
          "catches a corrupted record") {
  for (bool direct : {true, false}) {
    CAPTURE(direct);
    // A small block so that records span several blocks (each with its own checksum).
    SwapFile f(scratch_dir(), fmt::format("test-{}", direct), {direct, 3, 8192});
    if (!direct) CHECK_FALSE(f.direct());
    MESSAGE("swap file " << f.path() << (f.direct() ? ": O_DIRECT" : ": buffered"));
    // Page-aligned buffers padded to whole pages (as the host tier's are), and one that is
    // not aligned (buffered even in direct mode).
    const int64_t sizes[] = {1, 4096, 20000, 3 * 8192};
    std::vector<void*> buffers;
    for (int k = 0; k < 4; ++k) {
      void* p = nullptr;
      REQUIRE(posix_memalign(&p, 4096, static_cast<size_t>((sizes[k] + 4095) / 4096 * 4096)) == 0);
      const std::vector<char> v = pattern(sizes[k], k);
      std::memcpy(p, v.data(), v.size());
      buffers.push_back(p);
    }
    std::vector<char> odd = pattern(5001, 9);
    std::vector<SwapFile::Request> writes;
    // (Page-aligned and padded: O_DIRECT in direct mode, whatever the size.)
    for (int k = 0; k < 4; ++k) writes.push_back(f.write(k, buffers[k], sizes[k], /*padded=*/true));
    writes.push_back(f.write(99, odd.data() + 1, 5000));
    for (auto& w : writes) w.wait();
    CHECK(f.bytes_written() == 1 + 4096 + 20000 + 3 * 8192 + 5000);
    for (int k = 0; k < 4; ++k) std::memset(buffers[k], 0, static_cast<size_t>(sizes[k]));
    std::vector<char> back(5000);
    std::vector<SwapFile::Request> reads;
    for (int k = 3; k >= 0; --k) reads.push_back(f.read(k, buffers[k], sizes[k], /*padded=*/true));
    reads.push_back(f.read(99, back.data(), 5000));
    for (auto& r : reads) r.wait();
    for (int k = 0; k < 4; ++k) {
      CAPTURE(k);
      const std::vector<char> v = pattern(sizes[k], k);
      CHECK(std::memcmp(buffers[k], v.data(), v.size()) == 0);
    }
    CHECK(std::memcmp(back.data(), odd.data() + 1, 5000) == 0);
    CHECK(f.bytes_read() == f.bytes_written());
    // Records sit on 4096-byte boundaries: 4096 + 4096 + 20480 + 24576 + 8192.
    CHECK(f.file_bytes() == 61440);

    // Errors: a size other than the record's, a record never written.
    CHECK(contains(error_of([&] { f.read(2, buffers[2], 100).wait(); }),
                   "record 2 holds 20000 bytes, asked for 100"));
    CHECK(contains(error_of([&] { f.read(7, buffers[0], 1).wait(); }), "no record 7 was written"));

    // Another writer changes a byte of record 2's second block under us: its read fails.
    {
      const int fd = ::open(f.path().c_str(), O_WRONLY);
      REQUIRE(fd >= 0);
      const char flip = 'x';
      REQUIRE(::pwrite(fd, &flip, 1, 4096 + 4096 + 8192 + 5) == 1);
      ::close(fd);
    }
    const std::string err = error_of([&] { f.read(2, buffers[2], sizes[2]).wait(); });
    CHECK(contains(err, "record 2 fails its checksum at offset 16384"));
    // The other records still read back.
    f.read(3, buffers[3], sizes[3]).wait();
    for (void* p : buffers) std::free(p);
  }
  CHECK(contains(error_of([] { SwapFile f("/nonexistent/dir", "x", {}); }),
                 "--offload_dir '/nonexistent/dir' is not a directory"));
  CHECK(parse_offload_tier("nvme", "--offload_params") == OffloadTier::file);
  CHECK(parse_offload_tier("host", "--offload_params") == OffloadTier::host);
  CHECK(contains(error_of([] { parse_offload_tier("disk", "--offload_optimizer"); }),
                 "--offload_optimizer: unknown offload tier 'disk' (expected none, host or nvme)"));
}

// ---- training -----------------------------------------------------------------------------

struct Layout {
  int dp, stage;
  OffloadTier optimizer, params;
  int accum = 1;
  int64_t window = -1;  // OffloadOptions::window (-1: its default, which holds these models whole)
};

// A window that holds some of the test models' segments but not all (the formula test
// checks that a step's pages do not fit it).
constexpr int64_t kPartialWindow = 48 << 10;

std::string describe(const Layout& l) {
  return fmt::format("dp={} stage={} accum={} offload_optimizer={} offload_params={} window={}",
                     l.dp, l.stage, l.accum, offload_tier_name(l.optimizer),
                     offload_tier_name(l.params), l.window);
}

OffloadOptions offload_of(const Layout& l) {
  OffloadOptions o;
  o.optimizer = l.optimizer;
  o.params = l.params;
  o.dir = scratch_dir();
  o.io_block = 64 << 10;  // small models: several blocks per segment anyway
  if (l.window >= 0) o.window = l.window;
  return o;
}

// Rank 0's run (every rank's losses and parameters are checked equal to it).
Run run_layout(const Task& task, const Layout& l, bool offloaded,
               std::vector<ZeroOffloadReport>* reports = nullptr, int64_t stop = kOffloadSteps,
               int64_t start = 0, const Checkpoint* load = nullptr, Checkpoint* save = nullptr,
               bool complete_step = false, std::vector<double>* evals = nullptr) {
  std::vector<Run> runs(l.dp);
  std::vector<std::vector<ZeroOffloadReport>> rep(l.dp);
  std::vector<Checkpoint> saves(l.dp);  // every rank saves (collective); rank 0's is kept
  run_threads(l.dp, [&](CommPtr world) {
    ZeroRun spec{.stage = l.stage, .accum = l.accum, .start = start, .stop = stop};
    spec.load = load;
    if (save != nullptr) spec.save = &saves[world->rank()];
    if (offloaded) spec.offload = offload_of(l);
    spec.reports = &rep[world->rank()];
    spec.complete_step = complete_step;
    if (evals != nullptr) {
      // A schedule that changes the learning rate before every step's forward, and an
      // evaluation (no gradients) before every other one: at stage 3 on the file tier the
      // last step's updates then run inside it, at the rate the step saw.
      Communicator& comm = *world;
      spec.before_step = [&, evals](int64_t step, optim::Optimizer& opt, nn::Module& model) {
        opt.set_lr(task.lr * (1.0 + 0.25 * static_cast<double>(step % 4)));
        if (step % 2 == 0) return;
        NoGradGuard no_grad;
        Tensor loss = task.loss(model, DType::f32, step, comm.rank(), comm.size());
        Tensor total = Tensor::from_vector<double>({loss.item<double>()}, {1});
        comm.all_reduce(total, ReduceOp::sum);
        if (comm.rank() == 0) evals->push_back(total.item<double>());
      };
    }
    runs[world->rank()] = train_zero(*world, task, DType::f32, spec);
  });
  for (int r = 1; r < l.dp; ++r) {
    CAPTURE(r);
    CHECK(runs[r].losses == runs[0].losses);
    CHECK(runs[r].params == runs[0].params);
  }
  if (reports != nullptr) *reports = rep[0];
  if (save != nullptr) *save = saves[0];
  return runs[0];
}

bool bitwise(const Run& a, const Run& b) { return a.losses == b.losses && a.params == b.params; }

// Every tier combination of every stage over dp 1, 2, 4, bitwise the in-memory run.
int check_bitwise(const Task& task, const std::vector<int>& dps, const std::vector<int>& accums) {
  int configurations = 0;
  for (int dp : dps) {
    for (int stage : {1, 2, 3}) {
      for (int accum : accums) {
        const Run memory = run_layout(task, {dp, stage, OffloadTier::none, OffloadTier::none, accum}, false);
        CHECK(memory.losses.back() < memory.losses.front());  // it trains
        for (OffloadTier opt : {OffloadTier::host, OffloadTier::file}) {
          std::vector<OffloadTier> params = {OffloadTier::none};
          if (stage == 3) params.insert(params.end(), {OffloadTier::host, OffloadTier::file});
          for (OffloadTier p : params) {
            // The file tier with the default window (everything read ahead, written behind
            // and handed over), none, and one that holds some segments.
            std::vector<int64_t> windows = {-1};
            if (opt == OffloadTier::file) windows.insert(windows.end(), {0, kPartialWindow});
            for (int64_t window : windows) {
              const Layout l{dp, stage, opt, p, accum, window};
              const Run off = run_layout(task, l, true);
              INFO(task.name, ": ", describe(l));
              CHECK(off.losses.size() == static_cast<size_t>(kOffloadSteps));
              CHECK(bitwise(off, memory));
              ++configurations;
            }
          }
        }
      }
    }
  }
  return configurations;
}

TEST_CASE("offload: MNIST MLP, host and file tiers x stages 1-3 x dp 1, 2, 4 are bitwise the "
          "in-memory run") {
  // Per dp: stages 1 and 2 with the host tier and the file tier's three windows, stage 3
  // with those x three params tiers.
  CHECK(check_bitwise(mlp_task(), {1, 2, 4}, {1}) == 3 * (4 + 4 + 12));
}

TEST_CASE("offload: GPT-mini with accumulation, bitwise the in-memory run") {
  CHECK(check_bitwise(gpt_task(), {2}, {2}) == 4 + 4 + 12);
}

TEST_CASE("offload: a deferred update runs at its step's learning rate, inside an evaluation "
          "or the next forward, bitwise the in-memory run") {
  const Task task = gpt_task();
  int configurations = 0;
  for (int dp : {1, 2}) {
    std::vector<double> memory_evals;
    const Layout memory{dp, 3, OffloadTier::none, OffloadTier::none};
    const Run in_memory = run_layout(task, memory, false, nullptr, kOffloadSteps, 0, nullptr,
                                     nullptr, false, &memory_evals);
    REQUIRE(memory_evals.size() == static_cast<size_t>(kOffloadSteps / 2));
    for (OffloadTier params : {OffloadTier::none, OffloadTier::host, OffloadTier::file}) {
      for (int64_t window : {int64_t{-1}, int64_t{0}, kPartialWindow}) {
        const Layout l{dp, 3, OffloadTier::file, params, 1, window};
        INFO(describe(l));
        std::vector<double> evals;
        const Run off = run_layout(task, l, true, nullptr, kOffloadSteps, 0, nullptr, nullptr,
                                   false, &evals);
        CHECK(bitwise(off, in_memory));
        CHECK(evals == memory_evals);
        ++configurations;
      }
    }
  }
  CHECK(configurations == 2 * 3 * 3);
}

TEST_CASE("offload: the device stays under a budget the in-memory run exceeds") {
  const Task task = gpt_task();
  Allocator& cpu = allocator_for(kCPU);
  for (int dp : {1, 2}) {
    CAPTURE(dp);
    const Layout memory{dp, 3, OffloadTier::none, OffloadTier::none};
    const Layout file{dp, 3, OffloadTier::file, OffloadTier::file};
    cpu.reset_peak();
    process_memory().reset_peak();
    const Run in_memory = run_layout(task, memory, false, nullptr, 3);
    const int64_t memory_peak = cpu.stats().peak_bytes;
    const int64_t memory_state = process_memory().peak(MemoryTag::optimizer_state);
    cpu.reset_peak();
    process_memory().reset_peak();
    const Run offloaded = run_layout(task, file, true, nullptr, 3);
    const int64_t file_peak = cpu.stats().peak_bytes;
    MESSAGE(fmt::format("dp {}: device peak {} bytes in memory, {} offloaded", dp, memory_peak,
                        file_peak));
    CHECK(bitwise(offloaded, in_memory));
    // The offloaded device holds no optimizer state at all, and no parameter shards.
    CHECK(memory_state > 0);
    CHECK(process_memory().peak(MemoryTag::optimizer_state) == 0);
    CHECK(process_memory().current(MemoryTag::parameters) == 0);
    REQUIRE(file_peak < memory_peak);
    // A budget between the two peaks: the in-memory run fails on it, the offloaded one
    // trains under it, bitwise as before.
    const int64_t budget = (file_peak + memory_peak) / 2;
    const int64_t before = cpu.limit();
    cpu.set_limit(budget);
    std::string err;
    try {
      run_layout(task, memory, false, nullptr, 3);
    } catch (const Error& e) {
      err = e.what();
    }
    CHECK(contains(err, "would exceed the memory budget"));
    cpu.reset_peak();
    Run under;
    try {
      under = run_layout(task, file, true, nullptr, 3);
    } catch (...) {
      cpu.set_limit(before);
      throw;
    }
    cpu.set_limit(before);
    CHECK(cpu.stats().peak_bytes <= budget);
    CHECK(bitwise(under, in_memory));
  }
}

TEST_CASE("offload: the swap file's bytes per step equal the layout's formula") {
  const Task task = gpt_task();
  int configurations = 0;
  for (int dp : {1, 2}) {
    for (int stage : {1, 3}) {
      for (OffloadTier params : {OffloadTier::none, OffloadTier::host, OffloadTier::file}) {
        if (params != OffloadTier::none && stage != 3) continue;
        for (int accum : {1, 2}) {
         for (int64_t window : {int64_t{-1}, int64_t{0}, kPartialWindow}) {
          const Layout l{dp, stage, OffloadTier::file, params, accum, window};
          INFO(describe(l));
          std::vector<ZeroOffloadReport> reports;
          // Each step's deferred updates completed before its report: the step's reads and
          // writes fall in it.
          run_layout(task, l, true, &reports, 4, 0, nullptr, nullptr, /*complete_step=*/true);
          REQUIRE(reports.size() == 5);  // after construction, then after each step
          // AdamW on f32 parameters: exp_avg and exp_avg_sq, 8 bytes per element.
          const int64_t state = 8;
          const ZeroOffloadReport& r = reports.back();
          // Independently of the report's formula: a step writes each shard's parameters (4
          // bytes an element, unless they are kept on the host) and state (8), and reads them
          // back, but the first step has no state to read yet.
          const int64_t param = params == OffloadTier::host ? 0 : 4;
          const int64_t step_bytes = r.shard_elements * (param + state);
          CHECK(r.step_io_formula(state) == step_bytes);
          CHECK(r.shard_bytes == r.shard_elements * 4);
          const int64_t gathers =
              params == OffloadTier::file ? accum * r.gather_read_formula(1, false) : 0;
          // Stage 3 with the parameters on the file: an update leaves its parameter page for
          // the gather after it, so a step's first forward reads none of them.
          const int64_t handoff = stage == 3 && params == OffloadTier::file ? r.shard_bytes : 0;
          CHECK(r.handoff_bytes == handoff);
          CHECK(r.gather_read_formula(accum, true) == gathers - handoff);
          for (size_t k = 1; k < reports.size(); ++k) {
            CAPTURE(k);
            CHECK(reports[k].written_bytes - reports[k - 1].written_bytes == step_bytes);
            const int64_t reads =
                k == 1 ? r.shard_elements * param + gathers : step_bytes + gathers - handoff;
            CHECK(reports[k].read_bytes - reports[k - 1].read_bytes == reads);
          }
          // The window's peak: what it may hold, beside at most one segment's pages (the
          // one being written when it was full) and the parameter pages the updates leave
          // for the next forward (all of them here, the updates completed before it).
          CHECK(r.largest_segment_page_bytes > 0);
          CHECK(r.window_peak_bytes > 0);
          const int64_t holds = window == -1 ? OffloadOptions{}.window : window;
          const int64_t most = holds + r.largest_segment_page_bytes + handoff;
          CHECK(r.window_peak_bytes <= most);
          if (window == kPartialWindow) CHECK(step_bytes > most);  // it is partial
          // Construction writes the parameters once.
          CHECK(reports[0].written_bytes == r.shard_elements * param);
          CHECK(reports[0].read_bytes == 0);
          ++configurations;
         }
        }
      }
    }
  }
  CHECK(configurations == 2 * (2 + 6) * 3);
}

TEST_CASE("offload: a run saved offloaded resumes bitwise, in memory and offloaded") {
  const Task task = gpt_task();
  const Layout file{2, 3, OffloadTier::file, OffloadTier::file};
  const Layout memory{2, 3, OffloadTier::none, OffloadTier::none};
  const Run whole = run_layout(task, memory, false, nullptr, 6);
  Checkpoint saved;
  const Run first = run_layout(task, file, true, nullptr, 3, 0, nullptr, &saved);
  for (bool offloaded : {true, false}) {
    CAPTURE(offloaded);
    const Run rest = run_layout(task, offloaded ? file : memory, offloaded, nullptr, 6, 3, &saved);
    std::vector<double> losses = first.losses;
    losses.insert(losses.end(), rest.losses.begin(), rest.losses.end());
    CHECK(losses == whole.losses);
    CHECK(rest.params == whole.params);
  }
  // And a host-tier run resumes from an in-memory checkpoint.
  Checkpoint from_memory;
  run_layout(task, memory, false, nullptr, 3, 0, nullptr, &from_memory);
  const Run host = run_layout(task, {2, 2, OffloadTier::host, OffloadTier::none}, true, nullptr,
                              6, 3, &from_memory);
  const Run rest = run_layout(task, {2, 2, OffloadTier::none, OffloadTier::none}, false, nullptr,
                              6, 3, &from_memory);
  CHECK(bitwise(host, rest));
}

TEST_CASE("offload: a checkpoint loads into an optimizer that has already stepped (its state "
          "in the swap file), and training goes on as from there") {
  const Task task = gpt_task();
  run_threads(2, [&](CommPtr world) {
    std::shared_ptr<nn::Module> model = make_model(task, DType::f32);
    ZeroOptions z{.stage = 3, .units = task.units};
    z.offload = {.optimizer = OffloadTier::file, .params = OffloadTier::file, .dir = scratch_dir()};
    ZeroDataParallel zero(*model, *world, z);
    auto opt = make_optimizer(Opt::adamw, zero.param_groups(task.lr, kWeightDecay), task.lr);
    auto train_step = [&](int64_t step) {
      zero.zero_grad();
      Tensor loss = task.loss(*model, DType::f32, step, world->rank(), world->size());
      zero.backward(loss);
      zero.clip_grad_norm(kClip);
      zero.step(*opt);
      return loss.item<double>();
    };
    train_step(0);
    train_step(1);
    const nn::StateDict model_at_2 = zero.model_state_dict();
    const optim::Optimizer::StateDict opt_at_2 = zero.optimizer_state_dict(*opt);
    const double third = train_step(2);
    train_step(3);
    // Back to step 2 over state that is paged out: the same third step again, bitwise.
    zero.load_model_state_dict(model_at_2);
    zero.load_optimizer_state_dict(*opt, opt_at_2);
    CHECK(train_step(2) == third);
  });
}

TEST_CASE("offload: a swap file changed under a run fails its next read, naming the record") {
  // Stage 3 with nothing read ahead: the page written by the last update is read back by the
  // update deferred to the next forward, which finds the bytes changed.
  const Task task = gpt_task();
  const std::string dir = scratch_dir() + "/corrupted";
  REQUIRE(::mkdir(dir.c_str(), 0700) == 0);
  std::string err;
  try {
    run_threads(1, [&](CommPtr world) {
      ZeroRun spec{.stage = 3, .stop = 6};
      spec.offload = {.optimizer = OffloadTier::file, .params = OffloadTier::file, .dir = dir,
                      .window = 0};
      spec.before_step = [&](int64_t step, optim::Optimizer&, nn::Module&) {
        if (step != 3) return;
        DIR* d = ::opendir(dir.c_str());
        REQUIRE(d != nullptr);
        int changed = 0;
        while (dirent* e = ::readdir(d)) {
          if (std::string(e->d_name).find(".swap") == std::string::npos) continue;
          const int fd = ::open((dir + "/" + e->d_name).c_str(), O_WRONLY);
          REQUIRE(fd >= 0);
          const std::vector<char> junk(64, 0x5a);  // the first record: segment 0's parameters
          CHECK(::pwrite(fd, junk.data(), junk.size(), 0) == 64);
          ::close(fd);
          ++changed;
        }
        ::closedir(d);
        REQUIRE(changed == 1);
      };
      train_zero(*world, task, DType::f32, spec);
    });
  } catch (const Error& e) {
    err = e.what();
  }
  ::rmdir(dir.c_str());  // (the swap file is gone: removed when its run unwound)
  MESSAGE(err);
  CHECK(contains(err, "fails its checksum at offset 0"));
}

TEST_CASE("offload: errors name the flags and the sizes, before anything trains") {
  const Task task = gpt_task();
  Allocator& cpu = allocator_for(kCPU);
  // headroom >= 0: the device budget is set, once the model is built, to what is in use
  // plus this many bytes.
  auto build = [&](int stage, OffloadOptions o, int64_t headroom = -1) {
    run_threads(1, [&](CommPtr world) {
      std::shared_ptr<nn::Module> model = make_model(task, DType::f32);
      ZeroOptions z{.stage = stage, .units = task.units};
      z.offload = o;
      const int64_t before = cpu.limit();
      if (headroom >= 0) cpu.set_limit(cpu.stats().allocated_bytes + headroom);
      try {
        ZeroDataParallel zero(*model, *world, z);
      } catch (...) {
        cpu.set_limit(before);
        throw;
      }
      cpu.set_limit(before);
    });
  };
  CHECK(contains(error_of([&] { build(0, {.optimizer = OffloadTier::host}); }),
                 "offload_optimizer=host offload_params=none: offloading needs ZeRO stage 1-3"));
  CHECK(contains(error_of([&] { build(3, {.params = OffloadTier::host}); }),
                 "offload the optimizer too"));
  CHECK(contains(error_of([&] {
                   build(2, {.optimizer = OffloadTier::host, .params = OffloadTier::host});
                 }),
                 "offloading the parameters needs ZeRO stage 3"));
  CHECK(contains(error_of([&] {
                   build(3, {.optimizer = OffloadTier::file, .dir = "/nonexistent/dir"});
                 }),
                 "--offload_dir '/nonexistent/dir' is not a directory"));
  // A budget too small for even one unit: refused at construction, before any buffer. (The
  // model's own parameters, freed by stage 3, count as room.)
  const std::string err = error_of([&] {
    build(3, {.optimizer = OffloadTier::file, .params = OffloadTier::file, .dir = scratch_dir()},
          4096);
  });
  MESSAGE(err);
  CHECK(contains(err, "offload_optimizer=nvme offload_params=nvme: the device budget of"));
  CHECK(contains(err, "cannot hold even one unit"));
  CHECK(contains(err, "unit 'h.0' gathered"));
  // Stage 2 keeps whole parameters: the message says what would fit.
  CHECK(contains(error_of([&] { build(2, {.optimizer = OffloadTier::host}, 4096); }),
                 "use ZeRO stage 3 with --offload_params"));
  // An optimizer built on anything but param_groups() is refused at its first step.
  const std::string wrong = error_of([&] {
    run_threads(1, [&](CommPtr world) {
      std::shared_ptr<nn::Module> model = make_model(task, DType::f32);
      ZeroOptions z{.stage = 2, .units = task.units};
      z.offload = {.optimizer = OffloadTier::host};
      ZeroDataParallel zero(*model, *world, z);
      auto opt = make_optimizer(Opt::adamw, optim::decay_groups(model->named_parameters(), 1e-3, 0.1), 1e-3);
      zero.step(*opt);
    });
  });
  CHECK(contains(wrong, "build it on ZeroDataParallel::param_groups()"));
}

// ---- memory-centric tiling -----------------------------------------------------------------

// A model with a head much wider than the rest: a byte embedding and one hidden layer, then a
// Linear (or TiledLinear) head over kWideVocab classes. The tiled model takes the untiled
// one's values (its head's weight loaded into the tiles). Built in f64 on the host tier, as a
// model too big for the device is (ZeroDataParallel then takes a segment at a time).
constexpr int64_t kWideVocab = 8192, kWideWidth = 64, kWideTiles = 16, kWideTokens = 8;

struct WideHead : nn::Module {
  std::shared_ptr<nn::Embedding> emb;
  std::shared_ptr<nn::Linear> body;
  std::shared_ptr<nn::Module> head;
  explicit WideHead(bool tiled) : Module("WideHead") {
    HostTierScope host;
    manual_seed(0);
    emb = register_module("emb", std::make_shared<nn::Embedding>(256, kWideWidth, DType::f64));
    body = register_module("body", std::make_shared<nn::Linear>(kWideWidth, kWideWidth, true, DType::f64));
    auto whole = std::make_shared<nn::Linear>(kWideWidth, kWideVocab, true, DType::f64);
    if (!tiled) {
      head = register_module("head", whole);
      return;
    }
    auto t = std::make_shared<nn::TiledLinear>(kWideWidth, kWideVocab, kWideTiles, true, DType::f64);
    t->load_whole(whole->weight, whole->bias);
    head = register_module("head", t);
  }
  Tensor forward(const Tensor& idx) override { return (*head)(gelu((*body)((*emb)(idx)))); }
};

Task wide_head_task(bool tiled) {
  Task task;
  task.name = tiled ? "wide head, tiled" : "wide head";
  task.lr = 1e-2;
  task.units = {"body"};
  if (tiled) {
    nn::TiledLinear probe(kWideWidth, kWideVocab, kWideTiles);
    for (const std::string& p : probe.tile_paths("head")) task.units.push_back(p);
  } else {
    task.units.push_back("head");
  }
  task.make = [tiled] { return std::shared_ptr<nn::Module>(std::make_shared<WideHead>(tiled)); };
  task.loss = [](nn::Module& model, DType, int64_t step, int part, int parts) {
    // Tokens and labels from a counter-based hash of (step, position): every rank alike.
    std::vector<int64_t> idx, labels;
    for (int64_t i = 0; i < kWideTokens; ++i) {
      uint64_t h = (static_cast<uint64_t>(step) * 1000003u + static_cast<uint64_t>(i)) * 0x9E3779B97F4A7C15ull;
      h ^= h >> 29;
      idx.push_back(static_cast<int64_t>(h % 256));
      labels.push_back((idx.back() * 31 + 7) % kWideVocab);  // learnable: a function of the token
    }
    const int64_t rows = kWideTokens / parts;
    const Tensor x = Tensor::from_vector<int64_t>(idx, {kWideTokens}).narrow(0, part * rows, rows);
    const Tensor y = Tensor::from_vector<int64_t>(labels, {kWideTokens}).narrow(0, part * rows, rows);
    return cross_entropy(model(x), y);
  };
  return task;
}

TEST_CASE("offload: a head whose weight alone exceeds the device budget trains as tiles, equal "
          "to the untiled head") {
  const Task whole = wide_head_task(false), tiled = wide_head_task(true);
  const int64_t head_bytes = kWideVocab * kWideWidth * 8;  // f64
  Allocator& cpu = allocator_for(kCPU);
  auto run = [&](const Task& task, int dp, bool offloaded, int64_t stop = 6) {
    std::vector<Run> runs(dp);
    run_threads(dp, [&](CommPtr world) {
      ZeroRun spec{.stage = 3, .stop = stop};
      if (offloaded) {
        spec.offload = {.optimizer = OffloadTier::file, .params = OffloadTier::file,
                        .dir = scratch_dir()};
      }
      runs[world->rank()] = train_zero(*world, task, DType::f64, spec);
    });
    return runs[0];
  };
  // Tiles alone: the same training as the whole head, to f64 rounding (x's gradient is
  // summed over the tiles).
  const Run reference = run(whole, 1, false);
  CHECK(reference.losses.back() < reference.losses.front());
  auto head_of = [](const Run& r, bool tiles) {
    std::vector<double> w;
    for (size_t k = 0; k < r.names.size(); ++k) {
      const bool is_head = tiles ? r.names[k].rfind("head.", 0) == 0 && r.names[k].ends_with(".weight") && r.names[k] != "head.weight"
                                 : r.names[k] == "head.weight";
      if (is_head) w.insert(w.end(), r.params[k].begin(), r.params[k].end());  // tiles in order
    }
    return w;
  };
  auto same = [&](const Run& got, const Run& want) {
    double worst = 0;
    for (size_t i = 0; i < want.losses.size(); ++i) worst = std::max(worst, std::abs(got.losses[i] - want.losses[i]));
    const std::vector<double> a = head_of(got, true), b = head_of(want, false);
    REQUIRE(a.size() == b.size());
    double werr = 0;
    for (size_t i = 0; i < a.size(); ++i) werr = std::max(werr, std::abs(a[i] - b[i]));
    CHECK(worst <= 1e-12);
    CHECK(werr <= 1e-12);
  };
  for (int dp : {1, 2}) {
    CAPTURE(dp);
    // The tiled model offloaded to the swap file: its device peak (the largest unit is one
    // tile) stays below the head's weight alone.
    cpu.reset_peak();
    const Run offloaded = run(tiled, dp, true);
    const int64_t peak = cpu.stats().peak_bytes;
    MESSAGE(fmt::format("dp {}: head weight {} bytes; tiled and offloaded, device peak {}", dp,
                        head_bytes, peak));
    same(offloaded, reference);
    CHECK(offloaded.losses == run(tiled, dp, false).losses);  // bitwise its in-memory run
    REQUIRE(peak < head_bytes);
    // A budget of that peak: smaller than the head's weight alone. The untiled head is
    // refused up front; the tiled one trains under it.
    const int64_t before = cpu.limit();
    cpu.set_limit(peak + (64 << 10));
    const std::string err = error_of([&] { run(whole, dp, true); });
    Run under;
    std::string tiled_err;
    try {
      cpu.reset_peak();
      under = run(tiled, dp, true);
    } catch (const Error& e) {
      tiled_err = e.what();
    }
    const int64_t under_peak = cpu.stats().peak_bytes;
    cpu.set_limit(before);
    CHECK(contains(err, "cannot hold even one unit"));
    CHECK(contains(err, "unit 'head' gathered"));
    CHECK(tiled_err.empty());
    CHECK(under_peak <= peak + (64 << 10));
    CHECK(under.losses == offloaded.losses);
  }
}

}  // namespace
}  // namespace tessera::parallel
