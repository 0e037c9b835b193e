// Collective bandwidth as nccl-tests reports it: for all_reduce, all_gather, reduce_scatter
// and all_to_all on f32 buffers from --min_bytes to --max_bytes, the time of one call,
// algorithm bandwidth (bytes / time) and bus bandwidth (algbw x nccl-tests' factor: 2(n-1)/n
// for all_reduce, (n-1)/n for the others). "bytes" is the whole buffer as nccl-tests count
// it: all_reduce's buffer, all_gather's output, reduce_scatter's input, all_to_all's input.
//
//   bazel run //tools/bench:comm_bench -- --backend threads --ranks 4
//   mpirun -np 2 bazel-bin/tools/bench/comm_bench          # MPI, beside raw MPI calls
//   bazel run //tools/bench:comm_bench -- --backend memcpy  # the threads backend's ceiling
//
// Under mpirun the MPI backend is timed alternately, repetition by repetition, with the plain
// MPI call on the same buffers (MPI_Allreduce, MPI_Allgather, MPI_Reduce_scatter_block,
// MPI_Alltoall on MPI_COMM_WORLD), so the two see the same machine. A repetition starts with
// a barrier, loops the call until it took >= --min_ms, and counts the slowest rank's time per
// call; figures are medians over --reps repetitions after --warmup calls.
// tools/bench/run_comm_bench.sh runs every configuration.
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "models/common/flags.h"
#include "parallel/comm/mpi.h"
#include "parallel/comm/threads.h"
#include "tensor/tensor.h"

namespace {

using tessera::DType;
using tessera::Tensor;
using tessera::parallel::CommPtr;
using tessera::parallel::Communicator;
using tessera::parallel::ReduceOp;

struct Options {
  std::string backend = "auto";  // auto (mpi under mpirun, else threads), threads, mpi, memcpy
  int ranks = 2;                 // threads backend
  int64_t min_bytes = 1024;
  int64_t max_bytes = int64_t{256} << 20;
  int step = 4;
  int reps = 9;
  int warmup = 2;
  double min_ms = 10.0;
  std::string ops = "all_reduce,all_gather,reduce_scatter,all_to_all";
};

enum class Coll { all_reduce, all_gather, reduce_scatter, all_to_all };

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::all_reduce: return "all_reduce";
    case Coll::all_gather: return "all_gather";
    case Coll::reduce_scatter: return "reduce_scatter";
    case Coll::all_to_all: return "all_to_all";
  }
  return "?";
}

double bus_factor(Coll c, int n) {
  return c == Coll::all_reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

std::string size_str(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= 1024) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

double now_s() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

Tensor zeros(int64_t elements) {
  Tensor t = Tensor::empty({elements}, DType::f32);
  std::memset(t.raw_data(), 0, static_cast<size_t>(t.nbytes()));  // zeros stay zeros under sums
  return t;
}

// One rank's buffers for a collective over `bytes` (nccl-tests' size), n ranks.
struct Buffers {
  Tensor in, out;
};

Buffers make_buffers(Coll c, int64_t bytes, int n) {
  const int64_t all = bytes / 4;
  switch (c) {
    case Coll::all_reduce: {
      Tensor t = zeros(all);
      return {t, t};
    }
    case Coll::all_gather: return {zeros(all / n), zeros(all)};
    case Coll::reduce_scatter: return {zeros(all), zeros(all / n)};
    case Coll::all_to_all: return {zeros(all), zeros(all)};
  }
  return {};
}

std::function<void()> tessera_call(Coll c, Communicator& comm, const Buffers& b) {
  switch (c) {
    case Coll::all_reduce: return [&comm, b] { comm.all_reduce(b.in, ReduceOp::sum); };
    case Coll::all_gather: return [&comm, b] { comm.all_gather(b.out, b.in); };
    case Coll::reduce_scatter:
      return [&comm, b] { comm.reduce_scatter(b.out, b.in, ReduceOp::sum); };
    case Coll::all_to_all: return [&comm, b] { comm.all_to_all(b.out, b.in); };
  }
  return {};
}

// The same collective as one plain MPI call on MPI_COMM_WORLD.
std::function<void()> raw_mpi_call(Coll c, const Buffers& b, int n) {
  float* in = static_cast<float*>(b.in.raw_data());
  float* out = static_cast<float*>(b.out.raw_data());
  switch (c) {
    case Coll::all_reduce: {
      const int count = static_cast<int>(b.in.numel());
      return [=] { MPI_Allreduce(MPI_IN_PLACE, in, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); };
    }
    case Coll::all_gather: {
      const int count = static_cast<int>(b.in.numel());
      return [=] { MPI_Allgather(in, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD); };
    }
    case Coll::reduce_scatter: {
      const int count = static_cast<int>(b.out.numel());
      return [=] { MPI_Reduce_scatter_block(in, out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); };
    }
    case Coll::all_to_all: {
      const int count = static_cast<int>(b.in.numel() / n);
      return [=] { MPI_Alltoall(in, count, MPI_FLOAT, out, count, MPI_FLOAT, MPI_COMM_WORLD); };
    }
  }
  return {};
}

// The slowest rank's value (every rank gets it), through the communicator under test, outside
// the timed region.
double max_over_ranks(Communicator& comm, double v) {
  Tensor t = Tensor::from_vector<double>({v}, {1});
  comm.all_reduce(t, ReduceOp::max);
  return t.item<double>();
}

// Median seconds per call of each op, timed alternately repetition by repetition (the first
// one alternating too, so neither always runs on a cache the other warmed). Every rank
// derives the same loop count from the same all-reduced time, so all call the ops equally.
std::vector<double> time_calls(Communicator& comm, const Options& o,
                               const std::vector<std::function<void()>>& ops) {
  for (const auto& op : ops) {
    for (int i = 0; i < o.warmup; ++i) op();
  }
  comm.barrier();
  double t0 = now_s();
  ops[0]();
  const double once = max_over_ranks(comm, now_s() - t0);
  const int inner = std::clamp(static_cast<int>(o.min_ms * 1e-3 / std::max(once, 1e-7)), 1, 100000);
  std::vector<std::vector<double>> times(ops.size());
  for (int rep = 0; rep < o.reps; ++rep) {
    for (size_t i = 0; i < ops.size(); ++i) {
      const size_t k = rep % 2 ? ops.size() - 1 - i : i;  // who goes first alternates too
      comm.barrier();
      t0 = now_s();
      for (int j = 0; j < inner; ++j) ops[k]();
      times[k].push_back(max_over_ranks(comm, (now_s() - t0) / inner));
    }
  }
  std::vector<double> medians;
  for (auto& t : times) {
    std::sort(t.begin(), t.end());
    const size_t m = t.size() / 2;
    medians.push_back(t.size() % 2 ? t[m] : 0.5 * (t[m - 1] + t[m]));
  }
  return medians;
}

std::vector<Coll> parse_ops(const std::string& list) {
  std::vector<Coll> out;
  std::stringstream ss(list);
  std::string name;
  while (std::getline(ss, name, ',')) {
    bool found = false;
    for (Coll c : {Coll::all_reduce, Coll::all_gather, Coll::reduce_scatter, Coll::all_to_all}) {
      if (name == coll_name(c)) {
        out.push_back(c);
        found = true;
      }
    }
    TS_CHECK(found, "comm_bench: unknown collective '{}' in --ops '{}'", name, list);
  }
  return out;
}

double gbps(int64_t bytes, double seconds) { return bytes / seconds / 1e9; }

// Every collective and size on `world`; rank 0 prints one markdown table. With raw_mpi, the
// plain MPI call runs beside each Tessera call.
void bench_collectives(const CommPtr& world, const Options& o, bool raw_mpi) {
  const int n = world->size();
  const bool print = world->rank() == 0;
  if (print) {
    std::printf("\n### %s backend, %d ranks (f32; median of %d reps, each >= %.0f ms)\n\n",
                std::string(world->backend()).c_str(), n, o.reps, o.min_ms);
    if (raw_mpi) {
      std::printf(
          "| collective | bytes | Tessera us | raw MPI us | Tessera / raw | Tessera algbw GB/s "
          "| Tessera busbw GB/s | raw busbw GB/s |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
    } else {
      std::printf("| collective | bytes | time us | algbw GB/s | busbw GB/s |\n"
                  "|---|---:|---:|---:|---:|\n");
    }
    std::fflush(stdout);
  }
  for (Coll c : parse_ops(o.ops)) {
    for (int64_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.step) {
      if (bytes % (4 * n) != 0) continue;
      Buffers b = make_buffers(c, bytes, n);
      std::vector<std::function<void()>> ops = {tessera_call(c, *world, b)};
      if (raw_mpi) ops.push_back(raw_mpi_call(c, b, n));
      const std::vector<double> t = time_calls(*world, o, ops);
      if (!print) continue;
      const double alg = gbps(bytes, t[0]), bus = alg * bus_factor(c, n);
      if (raw_mpi) {
        const double raw_bus = gbps(bytes, t[1]) * bus_factor(c, n);
        std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", coll_name(c),
                    size_str(bytes).c_str(), t[0] * 1e6, t[1] * 1e6, t[0] / t[1], alg, bus,
                    raw_bus);
      } else {
        std::printf("| %s | %s | %.2f | %.2f | %.2f |\n", coll_name(c), size_str(bytes).c_str(),
                    t[0] * 1e6, alg, bus);
      }
      std::fflush(stdout);
    }
  }
}

// The threads backend's ceiling: one large memcpy on one thread, and the same copy split over
// every core (a read + write stream). Rates count bytes copied; traffic is twice that.
void bench_memcpy(const Options& o) {
  const int64_t bytes = o.max_bytes;
  std::vector<char> src(static_cast<size_t>(bytes), 1), dst(static_cast<size_t>(bytes), 0);
  auto median_s = [&](const std::function<void()>& op) {
    for (int i = 0; i < o.warmup; ++i) op();
    std::vector<double> t;
    for (int r = 0; r < o.reps; ++r) {
      const double t0 = now_s();
      op();
      t.push_back(now_s() - t0);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double one = median_s([&] { std::memcpy(dst.data(), src.data(), src.size()); });
  const int threads = omp_get_max_threads();
  const double all = median_s([&] {
#pragma omp parallel
    {
      const int64_t k = omp_get_thread_num(), parts = omp_get_num_threads();
      const int64_t lo = bytes * k / parts, hi = bytes * (k + 1) / parts;
      std::memcpy(dst.data() + lo, src.data() + lo, static_cast<size_t>(hi - lo));
    }
  });
  std::printf("\n### Memory bandwidth (%s buffers, median of %d)\n\n", size_str(bytes).c_str(),
              o.reps);
  std::printf("| copy | time ms | copied GB/s | read+write GB/s |\n|---|---:|---:|---:|\n");
  std::printf("| memcpy, 1 thread | %.2f | %.2f | %.2f |\n", one * 1e3, gbps(bytes, one),
              2 * gbps(bytes, one));
  std::printf("| memcpy split over %d threads | %.2f | %.2f | %.2f |\n", threads, all * 1e3,
              gbps(bytes, all), 2 * gbps(bytes, all));
  std::fflush(stdout);
  if (dst[static_cast<size_t>(bytes) - 1] != 1) std::printf("(copy check failed)\n");
}

Options parse(int argc, char** argv) {
  Options o;
  tessera::models::Flags f("comm_bench", "Collective bandwidth (see run_comm_bench.sh).");
  f.bind("backend", o.backend, "auto (mpi under mpirun, else threads), threads, mpi or memcpy");
  f.bind("ranks", o.ranks, "ranks of the threads backend");
  f.bind("min_bytes", o.min_bytes, "smallest buffer (nccl-tests' size)");
  f.bind("max_bytes", o.max_bytes, "largest buffer");
  f.bind("step", o.step, "size factor between rows");
  f.bind("reps", o.reps, "timed repetitions (the median is reported)");
  f.bind("warmup", o.warmup, "untimed calls first");
  f.bind("min_ms", o.min_ms, "each repetition loops the call until it takes this long");
  f.bind("ops", o.ops, "comma-separated collectives");
  f.parse(argc, argv);
  TS_CHECK(o.ranks >= 2 && o.reps >= 1 && o.warmup >= 0 && o.step >= 2 && o.min_bytes >= 4 &&
               o.max_bytes >= o.min_bytes,
           "comm_bench: need --ranks >= 2, --reps >= 1, --warmup >= 0, --step >= 2 and "
           "4 <= --min_bytes <= --max_bytes");
  if (o.backend == "auto") o.backend = tessera::parallel::mpi_launched() ? "mpi" : "threads";
  TS_CHECK(o.backend == "threads" || o.backend == "mpi" || o.backend == "memcpy",
           "comm_bench: unknown --backend '{}'", o.backend);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
    if (o.backend == "memcpy") {
      bench_memcpy(o);
    } else if (o.backend == "mpi") {
      bench_collectives(tessera::parallel::mpi_world(), o, /*raw_mpi=*/true);
    } else {
      tessera::parallel::run_threads(o.ranks, [&](CommPtr world) {
        bench_collectives(world, o, /*raw_mpi=*/false);
      });
    }
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
