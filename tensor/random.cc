#include "tensor/random.h"

namespace tessera {

Generator& default_generator() {
  thread_local Generator generator(0);
  return generator;
}

void manual_seed(uint64_t seed) { default_generator().set_state(seed, 0); }

}  // namespace tessera
