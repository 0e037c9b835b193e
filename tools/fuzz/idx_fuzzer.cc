// The IDX reader and the MNIST loader (models/data/idx.h) on arbitrary files, plain or
// gzip: they load or throw tessera::Error, nothing else. Input: a mode byte, then either
// one IDX file (read_idx) or u32 length + images file + labels file (load_mnist).
#include <cstdint>

#include "models/data/idx.h"
#include "tools/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  fuzz::Bytes in(data, size);
  const uint8_t mode = in.u8();
  try {
    if (mode % 2 == 0) {
      const data::IdxArray a = data::read_idx(fuzz::write_file("a-idx1-ubyte", in.rest()));
      int64_t n = 1;
      for (int64_t d : a.dims) n *= d;  // the reader checked this product
      if (static_cast<int64_t>(a.data.size()) != n) std::abort();
    } else {
      const std::string images = in.take(in.u32());
      fuzz::write_file("train-images-idx3-ubyte", images);
      fuzz::write_file("train-labels-idx1-ubyte", in.rest());
      const int64_t limit = static_cast<int64_t>(mode >> 1) - 1;  // -1: all
      const data::MnistSplit s = data::load_mnist(fuzz::scratch_dir(), true, 0.5, 0.25, limit);
      if (s.images.dim() != 4 || s.labels.size(0) != s.images.size(0)) std::abort();
    }
  } catch (const Error&) {
  }
  return 0;
}
