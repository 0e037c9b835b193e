// AdamW with 8-bit optimizer state (Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization", ICLR 2022; bitsandbytes' AdamW8bit): AdamW's update, each moment held
// between steps as one byte per element plus one scale per block of 256 (tensor/quant8.h).
// The state is 2 + 8/256 bytes per element instead of 8. step() issues one fused multi-tensor
// adamw8bit_ call per bucket (dequantize, update, requantize in one pass).
//
//   AdamW8bit opt(decay_groups(model.named_parameters(), 1e-3, 0.1),
//                 {.f32_state = [](const std::string& name) { return name == "wte.weight"; }});
//
// As bitsandbytes does, a tensor of fewer than min_8bit_numel elements keeps f32 state (the
// adamw_ update: biases and norms cost little and are the most sensitive), and so does any
// parameter `f32_state` names (the "stable embedding" advice: embedding rows see sparse,
// bursty gradients). f16/bf16 params get f32 master weights as in AdamW.
//
// State per parameter, 8-bit: exp_avg, exp_avg_sq (u8 codes, the param's shape),
// exp_avg_absmax, exp_avg_sq_absmax (f32 [ceil(numel / 256)]); f32: exp_avg, exp_avg_sq as
// AdamW's. Not elementwise (a block's scale is its largest element), so ZeRO stages 1-3 need
// ZeroOptions::block_shards = 256: each rank then holds whole blocks and updates them as one
// device would, bitwise.
//
// A tensor-parallel shard whose runs cut blocks (RowShard::run not a multiple of 256, as a
// row-parallel weight of 128 columns on tp 2 has) holds parts of blocks. Its scales are then
// the whole parameter's ([ceil(global numel / 256)] on every holder) and the update takes two
// passes (adamw8bit_segments_): the update and each block's local maxima, a max all-reduce of
// [2, blocks] values over the holders (RowShard::max), then the codes on the blocks' maxima.
// The result is bitwise the single device's.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <utility>

#include "optim/optimizer.h"

namespace tessera::optim {

struct AdamW8bitOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool master_weights = true;   // f32 master copies of f16/bf16 params
  int64_t min_8bit_numel = 4096;  // smaller tensors keep f32 state
  // Parameters (by name: ParamGroup::names, or the ZeRO shard's parameter) whose state stays
  // f32 whatever their size; null: none.
  std::function<bool(const std::string& name)> f32_state = nullptr;
};

class AdamW8bit : public Optimizer {
 public:
  explicit AdamW8bit(std::vector<Tensor> params, AdamW8bitOptions options = {});
  explicit AdamW8bit(std::vector<ParamGroup> groups, AdamW8bitOptions options = {});

  void step() override;
  bool elementwise() const override { return false; }
  bool fuses_grad_scale() const override { return true; }
  int64_t shard_block() const override;
  RowShardState row_shard_state(const std::string& name, const Shape& global, int64_t run,
                                int64_t run_first) const override;
  const AdamW8bitOptions& options() const { return options_; }
  // Whether parameter `param` (one this optimizer steps) holds 8-bit state.
  bool quantized(const Tensor& param) const;
  // Whether it holds 8-bit state as parts of the whole parameter's blocks (see above).
  bool cuts_blocks(const Tensor& param) const;

 protected:
  std::vector<StateSpec> state_specs(const Tensor& param) const override;
  std::map<std::string, double> hyperparameters() const override;
  void set_hyperparameters(const std::map<std::string, double>& values) override;

 private:
  static AdamW8bitOptions checked(AdamW8bitOptions options);
  bool uses_master(const Tensor& param) const;
  std::string name_of(const Tensor& param) const;
  // adamw8bit_segments_'s segments of a parameter that cuts blocks (computed once).
  const Tensor& segments_of(const Tensor& param, const RowShard& where);
  // Checks (run false) or runs (true) its two-pass update.
  void step_segments(const ParamGroup& group, const Pending& item, const RowShard& where,
                     bool run);

  AdamW8bitOptions options_;
  std::map<const TensorImpl*, Tensor> segments_;
  double step_grad_scale_ = 1.0;  // the step in progress's gradient scale (take_grad_scale)
};

}  // namespace tessera::optim
