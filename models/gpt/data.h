// Where the GPT training loop's batches come from (models/gpt/train.h): the corpus's
// training and validation windows (models/data/text.h), checked to hold a context, or
// uniform random tokens for --synthetic_data. Batches are built on the CPU.
//
//   GptData batches(config);
//   data::TextBatch b = batches.train(step, rank, ranks);   // this rank's rows
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "models/data/text.h"
#include "models/gpt/train.h"

namespace tessera::gpt {

// Uniform random tokens in [0, vocab) for --synthetic_data: global row r of batch `index` of
// `stream` (0: training, 1: validation) is Philox (seed, counter) over counters
// stream << 62 | (index * batch + r) * (context + 1) + t; targets are the next token, as in
// text windows. Rows [part * batch / parts, (part + 1) * batch / parts) make this part.
data::TextBatch synthetic_batch(uint64_t seed, uint64_t stream, int64_t index, int64_t batch,
                                int64_t context, int64_t vocab, int part, int parts);

class GptData {
 public:
  // Loads the corpus (Error naming the source when it cannot hold a context).
  explicit GptData(const GptTrainConfig& config);
  // This part's rows of the training batch at `step` (as TextWindows::get).
  data::TextBatch train(int64_t step, int part = 0, int parts = 1) const;
  // Validation batches, at least one.
  int64_t num_eval_batches() const;
  data::TextBatch eval(int64_t i) const;
  std::string str() const;

 private:
  const GptTrainConfig& c_;
  std::string source_;
  std::optional<data::TextWindows> train_, val_;
};

}  // namespace tessera::gpt
