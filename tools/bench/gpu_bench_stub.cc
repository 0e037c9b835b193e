// gpu_bench without --config=cuda: the benchmark needs the CUDA backend (tools/bench/gpu_bench.cc).
#include <cstdio>

int main() {
  std::fprintf(stderr, "gpu_bench: built without CUDA; rebuild with --config=cuda\n");
  return 1;
}
