// GPT on {pp, dp, tp} under MPI: one copy of this binary per rank, started by
// tests/parallel/comm_mpi_test.sh with mpirun -np 4. Every factorisation of the 4 ranks, each
// schedule where pp > 1, ZeRO 0 and 1, against the single-device run each process trains
// itself (f64, 1e-10), and in f32 with 1F1B and ZeRO 1 (1e-5; tests/models/gpt_3d_cases.h);
// part of the composition matrix (ZeRO 2/3, accumulation, recomputation, dropout, bf16);
// Adafactor and 8-bit AdamW on a few layouts; Mixture of Experts (E = 8) over ep, dp, tp and
// pp.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "models/gpt/train.h"
#include "parallel/comm/mpi.h"
#include "tests/models/gpt_3d_cases.h"

namespace tessera::gpt {
namespace {

TEST_CASE("3-D over mpi: every pp x dp x tp factorisation of 4 processes equals one device") {
  parallel::CommPtr world = parallel::mpi_world();
  REQUIRE(world->size() == 4);
  const testing3d::Run ref = testing3d::reference();
  // pp 1: dp 1, 2, 4 with 1F1B only = 3 layouts; pp 2: dp 1, 2 x GPipe, 1F1B, interleaved
  // = 6; pp 4: dp 1 x 3 = 3 (interleaved's 8 stages fit the 8 pipeline layers). 12 layouts x
  // ZeRO 0/1 = 24 runs.
  CHECK(testing3d::check_factorisations(world, ref) == 24);
}

TEST_CASE("3-D over mpi in f32: every factorisation of 4 processes with 1F1B and ZeRO 1") {
  parallel::CommPtr world = parallel::mpi_world();
  const testing3d::Run ref = testing3d::reference(DType::f32);
  CHECK(testing3d::check_factorisations_f32(world, ref) == 6);
}

TEST_CASE("composition over mpi: accumulation, recomputation and dropout on every layout, f64 and bf16") {
  // The threads suite's subset (gpt_compose_test) where accumulation or recomputation is
  // on with dropout, in f64 and bf16: two configurations per layout and precision.
  std::vector<testing3d::Combo> combos;
  for (const testing3d::Combo& c : testing3d::composition_subset(4)) {
    const bool precision = c.precision == DType::f64 || c.precision == DType::bf16;
    if (precision && c.dropout > 0 && c.recompute != "none") combos.push_back(c);
  }
  CHECK(combos.size() == 6 * 2 * 2);
  CHECK(testing3d::check_compositions(parallel::mpi_world(), combos) == 24);
}

TEST_CASE("optimizers over mpi: Adafactor on pp x tp and dp x tp, 8-bit AdamW on pp x dp and dp x tp, as one device") {
  // gpt --check in each process of the 4 (tests/models/gpt_check_test runs the same on
  // threads, with the reasons for its bounds): Adafactor's statistics summed over tp and dp
  // by MPI (1e-5: the key bias, whose exact gradient is zero, moves by rounding noise over
  // sqrt(eps1); everything else of step 0 agrees to 1e-9, asserted on threads); 8-bit AdamW's
  // codes on ZeRO's block shards (1e-9), and on tp shards that cut attn.c_proj's blocks (runs
  // of 32 at width 64: the blocks' scales max-reduced over tp and dp by MPI).
  struct L {
    const char* optimizer;
    int pp, dp, tp, zero;
  };
  int runs = 0;
  for (const L& l : {L{"adafactor", 2, 1, 2, 0}, L{"adafactor", 1, 2, 2, 3},
                     L{"adamw8bit", 2, 2, 1, 2}, L{"adamw8bit", 1, 2, 2, 3}}) {
    CAPTURE(std::string(l.optimizer));
    CAPTURE(l.tp);
    GptTrainConfig c;
    c.layers = 2;
    c.heads = 4;
    c.width = std::string(l.optimizer) == "adamw8bit" ? 64 : 16;  // (8-bit from 4096 elements)
    c.context = 16;
    c.batch = 8;
    c.steps = 2;
    c.lr = 1e-2;
    c.warmup = 0;
    c.check = true;
    c.verbose = false;
    c.threads = 1;
    c.optimizer = l.optimizer;
    c.adafactor_beta1 = 0.9;
    c.pp = l.pp;
    c.dp = l.dp;
    c.tp = l.tp;
    c.zero = l.zero;
    if (std::string(l.optimizer) == "adafactor") c.check_tolerance = 1e-5;
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    ++runs;
  }
  CHECK(runs == 4);
}

TEST_CASE("experts over mpi: dropless E = 8, k = 2 on ep x dp, tp and pp layouts of 4 processes, as one device") {
  // gpt --check (f64, 1e-9 per tensor) in each of the 4 processes: Mixture-of-Experts blocks
  // (8 experts, top-2, balancing and z-losses) with the experts over ep ranks of dp, on tp
  // and pp; routing counts and the all-to-alls by MPI.
  struct L {
    const char* name;
    int pp, dp, tp, ep, zero, microbatches;
  };
  int runs = 0;
  for (const L& l : {L{"dp 4 x ep 4, ZeRO 3", 1, 4, 1, 4, 3, 1}, L{"dp 4 x ep 2, ZeRO 1", 1, 4, 1, 2, 1, 1},
                     L{"pp 2 x dp 2 x ep 2, 2 micro-batches", 2, 2, 1, 2, 0, 2},
                     L{"dp 2 x tp 2 x ep 2, ZeRO 2", 1, 2, 2, 2, 2, 1}}) {
    CAPTURE(std::string(l.name));
    GptTrainConfig c;
    c.layers = 2;
    c.heads = 2;
    c.width = 16;
    c.context = 16;
    c.batch = 8;
    c.steps = 2;
    c.lr = 1e-2;
    c.warmup = 0;
    c.check = true;
    c.verbose = false;
    c.threads = 1;
    c.experts = 8;
    c.moe_top_k = 2;
    c.moe_every = 1;
    c.aux_loss = 0.01;
    c.z_loss = 0.001;
    c.pp = l.pp;
    c.dp = l.dp;
    c.tp = l.tp;
    c.ep = l.ep;
    c.zero = l.zero;
    c.microbatches = l.microbatches;
    const GptResult r = train_gpt(c);
    MESSAGE(r.check_report);
    CHECK(r.check_ok);
    ++runs;
  }
  CHECK(runs == 4);
}

}  // namespace
}  // namespace tessera::gpt
