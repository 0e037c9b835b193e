// The MPI backend's tests: one copy of this binary per rank, started by comm_mpi_test.sh
// (mpirun -np 2 and -np 4). Every rank runs every test case in the same order, because each
// one issues collectives; a failed CHECK on one rank fails that rank's exit status, which
// mpirun passes on.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "parallel/comm/mpi.h"
#include "tests/parallel/collective_checks.h"
#include "tests/testing.h"

namespace tessera::parallel {
namespace {

using tessera::testing::contains;
using tessera::testing::error_of;

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? -1 : std::atoi(v);
}

TEST_CASE("mpi: world matches mpirun's layout") {
  CHECK(mpi_launched());
  CommPtr world = mpi_world();
  CHECK(world->backend() == "mpi");
  CHECK(world->name() == "world");
  CHECK(world->size() == env_int("OMPI_COMM_WORLD_SIZE"));
  CHECK(world->rank() == env_int("OMPI_COMM_WORLD_RANK"));
  CHECK(mpi_world() == world);  // one world per process
}

TEST_CASE("mpi: every collective, dtype and layout") {
  testing::check_collectives(mpi_world());
}

TEST_CASE("mpi: an MPI failure names the call, group and rank") {
  CommPtr world = mpi_world();
  const int n = world->size();
  // Rank 0 sends 8 elements; rank 1 posts a 4-element recv: MPI reports truncation there.
  if (world->rank() == 0) {
    world->send(Tensor::from_vector<float>({1, 2, 3, 4, 5, 6, 7, 8}, {8}), 1, 5);
  } else if (world->rank() == 1) {
    Tensor small = Tensor::empty({4});
    const std::string msg = error_of([&] { world->recv(small, 0, 5); });
    CHECK(contains(msg, fmt::format("mpi: MPI_Irecv on group 'world' failed on rank 1 of {}: ",
                                    n)));
    CHECK(contains(msg, "MPI_ERR_TRUNCATE"));
  }
  world->barrier();
  // Tags MPI cannot carry are a user error caught before MPI sees them.
  if (world->rank() == 0) {
    CHECK(contains(error_of([&] { world->send(Tensor::empty({1}), 1, -3); }),
                   "mpi: send on group 'world' (rank 0 of"));
  }
}

TEST_CASE("mpi: f16 and bf16 sums accumulate in f32 and round once") {
  CommPtr world = mpi_world();
  const int n = world->size();
  // 1 + (n-1) * 2^-11 in f16: each partial sum 1 + 2^-11 is a tie that f16 rounds down to 1,
  // so adding in f16 would give 1; the f32 sum rounded once gives 1 for n = 2 and 1 + 2^-9
  // for n = 4 (3 * 2^-11 is a tie between 1 + 2^-10 and the even 1 + 2^-9). bf16's ulp at 1
  // is 2^-7, so bf16 gives 1 either way.
  REQUIRE((n == 2 || n == 4));
  const float mine = world->rank() == 0 ? 1.0f : 1.0f / 2048.0f;
  const float f16_sum = n == 2 ? 1.0f : 1.0f + 1.0f / 512.0f;
  for (DType dt : {DType::f16, DType::bf16}) {
    Tensor t = Tensor::from_vector<float>({mine, -mine}, {2}).cast(dt);
    world->all_reduce(t, ReduceOp::sum);
    const float want = dt == DType::f16 ? f16_sum : 1.0f;
    CHECK(t.to_vector<float>() == std::vector<float>{want, -want});
  }
}

TEST_CASE("mpi: buffers above the int count limit go in chunks or fail clearly") {
  CommPtr world = mpi_world();
  const int n = world->size(), r = world->rank();
  const int64_t saved = internal::set_mpi_max_count(3);
  std::vector<float> values(10);
  for (int i = 0; i < 10; ++i) values[i] = static_cast<float>(i + 100 * r);
  float rank_sum = 0;
  for (int k = 0; k < n; ++k) rank_sum += 100.0f * k;

  // all_reduce: 10 elements in chunks of 3, blocking and posted.
  Tensor a = Tensor::from_vector<float>(values, {10});
  world->all_reduce(a, ReduceOp::sum);
  Tensor b = Tensor::from_vector<float>(values, {10});
  WorkHandle h = world->all_reduce_async(b, ReduceOp::max);
  (void)h->is_completed();  // posts it; whether it already finished depends on timing
  h->wait();
  for (int i = 0; i < 10; ++i) {
    CHECK(a.to_vector<float>()[i] == n * i + rank_sum);
    CHECK(b.to_vector<float>()[i] == i + 100.0f * (n - 1));
  }

  // broadcast and send/recv of 7 elements (chunks 3, 3, 1).
  Tensor c = Tensor::from_vector<float>({values.begin(), values.begin() + 7}, {7});
  world->broadcast(c, n - 1);
  for (int i = 0; i < 7; ++i) CHECK(c.to_vector<float>()[i] == i + 100.0f * (n - 1));
  // A ring: everyone sends first, then receives (sends never wait for the recv).
  Tensor out = Tensor::from_vector<float>(values, {10});
  Tensor in = Tensor::empty({10});
  world->send(out, (r + 1) % n, 7);
  world->recv(in, (r + n - 1) % n, 7);
  const int left = (r + n - 1) % n;
  for (int i = 0; i < 10; ++i) CHECK(in.to_vector<float>()[i] == i + 100.0f * left);

  // all_gather's whole output (2n elements) exceeds 3: a clear error, on every rank alike.
  Tensor gathered = Tensor::empty({2 * n});
  const std::string msg = error_of([&] { world->all_gather(gathered, Tensor::empty({2})); });
  CHECK(contains(msg, "mpi: all_gather on group 'world'"));
  CHECK(contains(msg, "MPI's int counts allow (3)"));
  internal::set_mpi_max_count(saved);
  world->barrier();
}

TEST_CASE("mpi: async handles complete in any wait order, across communicators") {
  CommPtr world = mpi_world();
  const int n = world->size(), r = world->rank();
  CommPtr pairs = world->split(r / 2, r, "pairs");
  CHECK(pairs->name() == "pairs");
  CHECK(pairs->backend() == "mpi");
  CHECK(pairs->size() == std::min(2, n - r / 2 * 2));
  CHECK(pairs->rank() == r % 2);

  Tensor x = Tensor::from_vector<double>({1.0 + r}, {1});
  Tensor y = Tensor::from_vector<int64_t>({int64_t{1} << r}, {1});
  Tensor z = Tensor::from_vector<float>({2.0f * r}, {1});
  Tensor g = Tensor::empty({n}, DType::f64);
  WorkHandle hx = world->all_reduce_async(x, ReduceOp::avg);
  WorkHandle hy = pairs->all_reduce_async(y, ReduceOp::sum);
  WorkHandle hz = world->all_reduce_async(z, ReduceOp::min);
  WorkHandle hb = world->barrier_async();
  WorkHandle hg = world->all_gather_async(g, Tensor::from_vector<double>({0.5 * r}, {1}));
  while (!hx->is_completed()) {
  }
  hg->wait();
  hb->wait();
  hz->wait();
  hy->wait();
  hx->wait();  // already complete: returns at once
  double mean = 0;
  for (int k = 0; k < n; ++k) mean += (1.0 + k) / n;
  CHECK(x.item<double>() == doctest::Approx(mean).epsilon(1e-15));
  const int first = r / 2 * 2;
  int64_t pair_sum = 0;
  for (int k = first; k < std::min(first + 2, n); ++k) pair_sum += int64_t{1} << k;
  CHECK(y.item<int64_t>() == pair_sum);
  CHECK(z.item<float>() == 0.0f);
  for (int k = 0; k < n; ++k) CHECK(g.to_vector<double>()[k] == 0.5 * k);
}

}  // namespace
}  // namespace tessera::parallel
