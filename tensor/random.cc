#include "tensor/random.h"

#include "tensor/error.h"

namespace tessera {

Generator& default_generator() {
  thread_local Generator generator(0);
  return generator;
}

void manual_seed(uint64_t seed) { default_generator().set_state(seed, 0); }

namespace {
thread_local const BatchSlice* g_slice = nullptr;
}  // namespace

BatchSliceScope::BatchSliceScope(BatchSlice slice) : previous_(g_slice), slice_(slice) {
  TS_CHECK(slice.rows >= 0 && slice.start >= 0 && slice.start + slice.rows <= slice.global_rows,
           "BatchSliceScope: rows [{}, {}) are not inside a batch of {}", slice.start,
           slice.start + slice.rows, slice.global_rows);
  g_slice = &slice_;
}

BatchSliceScope::BatchSliceScope(const BatchSlice* slice)
    : previous_(g_slice), slice_(slice != nullptr ? *slice : BatchSlice{}) {
  g_slice = slice != nullptr ? &slice_ : nullptr;
}

BatchSliceScope::~BatchSliceScope() { g_slice = previous_; }

const BatchSlice* current_batch_slice() { return g_slice; }

}  // namespace tessera
