// GPT on {pp, dp, tp} under MPI: one copy of this binary per rank, started by
// tests/parallel/comm_mpi_test.sh with mpirun -np 4. Every factorisation of the 4 ranks, each
// schedule where pp > 1, ZeRO 0 and 1, against the single-device run each process trains
// itself (f64, 1e-10; tests/models/gpt_3d_cases.h).
#include <doctest/doctest.h>

#include "parallel/comm/mpi.h"
#include "tests/models/gpt_3d_cases.h"

namespace tessera::gpt {
namespace {

TEST_CASE("3-D over mpi: every pp x dp x tp factorisation of 4 processes equals one device") {
  parallel::CommPtr world = parallel::mpi_world();
  REQUIRE(world->size() == 4);
  const testing3d::Run ref = testing3d::reference();
  CHECK(testing3d::check_factorisations(world, ref) >= 20);
}

}  // namespace
}  // namespace tessera::gpt
