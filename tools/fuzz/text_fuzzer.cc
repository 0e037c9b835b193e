// The text data reader (models/data/text.h) on arbitrary files and window parameters: the
// corpus loads or throws tessera::Error, and every batch it hands out (or refuses with an
// Error) has the asked shape with targets the next byte of each window.
#include <cstdint>

#include "models/data/text.h"
#include "tools/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  fuzz::Bytes in(data, size);
  const int64_t context = static_cast<int64_t>(in.u8()) - 8;
  const int64_t batch = static_cast<int64_t>(in.u8() % 16) - 2;
  const int64_t step = static_cast<int64_t>(in.u32()) - 16;
  const int world = 1 + in.u8() % 4, rank = in.u8() % 5;
  try {
    const data::TextCorpus corpus = data::load_text(fuzz::write_file("corpus.txt", in.rest()));
    for (data::TextSplit split : {data::TextSplit::train, data::TextSplit::val}) {
      const data::TextWindows w(corpus, split, 7);
      try {
        const data::TextBatch b = w.get(step, batch, context, rank, world);
        if (b.idx.shape() != Shape{batch / world, context}) std::abort();
        const int64_t* idx = b.idx.data<int64_t>();
        const int64_t* tgt = b.targets.data<int64_t>();
        for (int64_t i = 0; i + 1 < context; ++i) {
          if (tgt[i] != idx[i + 1]) std::abort();  // row 0's targets: the next bytes
        }
      } catch (const Error&) {
      }
      try {
        const int64_t n = w.num_eval_batches(batch, context);
        if (n > 0) w.eval_batch(n - 1, batch, context, rank, world);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
