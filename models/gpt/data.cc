#include "models/gpt/data.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "tensor/random.h"

namespace tessera::gpt {

data::TextBatch synthetic_batch(uint64_t seed, uint64_t stream, int64_t index, int64_t batch,
                                int64_t context, int64_t vocab, int part, int parts) {
  const int64_t rows = batch / parts, first = part * rows, width = context + 1;
  std::vector<int64_t> idx(static_cast<size_t>(rows * context)),
      targets(static_cast<size_t>(rows * context));
  std::vector<int64_t> window(static_cast<size_t>(width));
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t base = stream << 62 | static_cast<uint64_t>((index * batch + first + r) * width);
    for (int64_t t = 0; t < width; ++t) {
      const double u = philox::uniform_f64(seed, base + static_cast<uint64_t>(t));
      window[t] = std::min(static_cast<int64_t>(u * static_cast<double>(vocab)), vocab - 1);
    }
    std::copy(window.begin(), window.end() - 1, idx.begin() + r * context);
    std::copy(window.begin() + 1, window.end(), targets.begin() + r * context);
  }
  return {Tensor::from_vector(idx, {rows, context}), Tensor::from_vector(targets, {rows, context})};
}

GptData::GptData(const GptTrainConfig& config) : c_(config) {
  if (c_.synthetic_data) return;
  TS_CHECK(c_.vocab >= data::kByteVocab,
           "gpt: --vocab {} is smaller than the {} byte values of text; use --synthetic_data "
           "for other vocabularies",
           c_.vocab, data::kByteVocab);
  source_ = c_.data.empty() ? data::kFortunesDir : c_.data;
  const data::TextCorpus corpus = data::load_text(source_);
  const uint64_t seed = static_cast<uint64_t>(c_.seed);
  train_.emplace(corpus, data::TextSplit::train, seed);
  val_.emplace(corpus, data::TextSplit::val, seed);
  TS_CHECK(c_.context < train_->size() && c_.context < val_->size(),
           "gpt: --context {} needs more bytes than the {} training / {} validation bytes of {}",
           c_.context, train_->size(), val_->size(), source_);
}

data::TextBatch GptData::train(int64_t step, int part, int parts) const {
  if (!train_) {
    TS_CHECK(c_.batch % parts == 0, "gpt: batch {} does not split into {} parts", c_.batch,
             parts);
    return synthetic_batch(static_cast<uint64_t>(c_.seed), 0, step, c_.batch, c_.context,
                           c_.vocab, part, parts);
  }
  return train_->get(step, c_.batch, c_.context, part, parts);
}

int64_t GptData::num_eval_batches() const {
  if (!val_) return kSyntheticEvalBatches;
  const int64_t n = val_->num_eval_batches(c_.batch, c_.context);
  TS_CHECK(n > 0, "gpt: the validation split ({} bytes) holds no batch of {} x {} bytes",
           val_->size(), c_.batch, c_.context);
  return n;
}

data::TextBatch GptData::eval(int64_t i) const {
  if (!val_) {
    return synthetic_batch(static_cast<uint64_t>(c_.seed), 1, i, c_.batch, c_.context, c_.vocab,
                           0, 1);
  }
  return val_->eval_batch(i, c_.batch, c_.context);
}

std::string GptData::str() const {
  if (!train_) return fmt::format("random tokens in [0, {})", c_.vocab);
  return fmt::format("{} train / {} val bytes", train_->size(), val_->size());
}

}  // namespace tessera::gpt
