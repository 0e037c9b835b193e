// The README's sharded example (models/sharded/sharded_mlp.cc, between the "README snippet"
// markers) must match the README text, give the single-device loss and gradients on every
// mesh shape, and communicate exactly as described: one all_reduce over tp in forward, one
// per replicated weight over dp in backward.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "models/sharded/sharded_mlp.h"
#include "parallel/comm/threads.h"
#include "tests/testing.h"

namespace tessera::examples {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot open " << path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void check_close(const Tensor& got, const Tensor& want, const char* what) {
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  REQUIRE(g.size() == w.size());
  for (size_t i = 0; i < g.size(); ++i) {
    // f32 sums split differently across ranks: 1e-5 relative to the magnitude.
    CHECK_MESSAGE(std::abs(g[i] - w[i]) <= 1e-5 * (1.0 + std::abs(w[i])), what << "[" << i << "]");
  }
}

TEST_CASE("the README's sharded snippet is the code the example runs") {
  const std::string code = read("models/sharded/sharded_mlp.cc");
  const size_t a = code.find("// README snippet begins\n");
  const size_t b = code.find("// README snippet ends");
  REQUIRE(a != std::string::npos);
  REQUIRE(b != std::string::npos);
  const std::string snippet = code.substr(a + 25, b - a - 25);
  CHECK_MESSAGE(read("README.md").find(snippet) != std::string::npos,
                "README.md does not contain the snippet from models/sharded/sharded_mlp.cc");
}

TEST_CASE("the sharded MLP step equals the single-device step on every mesh shape") {
  const ShardedMlpResult ref = single_device_mlp_step();
  // Plain variables, not a structured binding: lambdas capture them (clang < 16 rejects that).
  for (const auto& mesh :
       {std::pair<int64_t, int64_t>{1, 1}, {2, 1}, {1, 2}, {2, 2}, {1, 4}, {4, 1}, {2, 4}}) {
    const int64_t dp = mesh.first, tp = mesh.second;
    parallel::run_threads(static_cast<int>(dp * tp), [&](CommPtr world) {
      const ShardedMlpResult r = sharded_mlp_step(world, dp, tp);
      check_close(r.loss, ref.loss, "loss");
      check_close(r.grad_w1, ref.grad_w1, "grad w1");
      check_close(r.grad_w2, ref.grad_w2, "grad w2");
      if (dp == 2 && tp == 2) {
        using testing::contains;
        CHECK(contains(r.describe_h, "placements [S(0), S(1)]"));
        // Forward: the tp all_reduce asked for by with_sharding_constraint; backward: one
        // all_reduce over dp per replicated weight (data parallelism's gradient sum).
        auto count = [&](const std::string& op, const std::string& group) {
          int n = 0;
          std::istringstream lines(r.comm_log);
          for (std::string line; std::getline(lines, line);) {
            n += line.rfind(op, 0) == 0 && contains(line, "group=" + group + " ");
          }
          return n;
        };
        CHECK(count("all_reduce", "tp") == 1);
        CHECK(count("all_reduce", "dp") == 2);
        CHECK(count("all_gather", "tp") == 0);
        CHECK(contains(r.comm_log, "cause=with_sharding_constraint"));
        CHECK(contains(r.comm_log, "cause=matmul backward (replicated input)"));
      }
    });
  }
}

}  // namespace
}  // namespace tessera::examples
