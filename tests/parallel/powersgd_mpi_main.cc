// PowerSGD as DDP's comm hook under MPI: one copy of this binary per rank, started by
// comm_mpi_test.sh (mpirun -np 4). Each process runs its rank's DDP with the hook over the
// MPI world and compares its reduced gradients, round by round, with the independent f64
// PowerSGD of powersgd_reference.h (which computes every rank's inputs itself); the
// error-feedback state resumes bitwise.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <string>

#include "parallel/comm/mpi.h"
#include "tests/parallel/powersgd_reference.h"

namespace tessera::parallel {
namespace {

using namespace testing_powersgd;

TEST_CASE("PowerSGD over mpi: each rank's gradients equal the f64 reference; resume bitwise") {
  CommPtr world = mpi_world();
  REQUIRE(world->size() == 4);
  int configs = 0;
  for (int64_t rank : {1, 2}) {
    CAPTURE(rank);
    const PowerSgdOptions o{.rank = rank, .start_iter = 2, .initial_q = q0_of};
    // At rank 1, buckets of 600 bytes (three: their P all-reduces in flight together).
    const int64_t bucket_bytes = rank == 1 ? 600 : int64_t{25} << 20;
    const RankRun run = run_rank(*world, 0, 6, o, nullptr, bucket_bytes);
    CHECK(run.places.at("w1").first == (rank == 1 ? 2 : 0));
    std::vector<RefParam> ref = ref_params(world->size(), rank);
    const auto want = reference(ref, world->size(), 6, 2, run.places);
    const double worst = worst_relative(run.grads, want);
    MESSAGE("mpi rank ", world->rank(), " of 4, PowerSGD rank ", rank, ": largest relative difference ", worst);
    CHECK(worst <= 1e-12);
    // Rounds 3-5 again from the state after round 2.
    const RankRun head = run_rank(*world, 0, 3, o, nullptr, bucket_bytes);
    const RankRun tail = run_rank(*world, 3, 3, o, &head.state, bucket_bytes);
    for (size_t t = 0; t < 3; ++t) CHECK(tail.grads[t] == run.grads[3 + t]);
    ++configs;
  }
  CHECK(configs == 2);
}

}  // namespace
}  // namespace tessera::parallel
