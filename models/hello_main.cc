// bazel run //models:hello -- [steps]
// Trains the tiny blob classifier (models/hello.h) and prints its progress.
#include <cstdio>
#include <cstdlib>

#include "models/hello.h"
#include "tensor/error.h"

int main(int argc, char** argv) {
  tessera::models::HelloConfig config;
  if (argc > 1) config.steps = std::atoll(argv[1]);
  if (config.steps <= 0) {
    std::fprintf(stderr, "usage: hello [steps > 0]\n");
    return 2;
  }
  try {
    const auto r = tessera::models::train_hello(config, [](int64_t step, double loss) {
      std::printf("step %5lld  loss %.4f\n", static_cast<long long>(step), loss);
    });
    std::printf("held-out accuracy: %.2f%%\n", 100.0 * r.accuracy);
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
