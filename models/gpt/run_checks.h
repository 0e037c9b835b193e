// What `train_gpt` checks before it allocates anything: every field of the configuration
// (an Error naming the flag and the value, never a silent clamp), and the memory the run
// will need, predicted from the model, the batch and the layout so that a run that cannot
// fit is refused with the numbers instead of being killed by the kernel half-way.
//
//   validate_train_config(config);                       // Error: "gpt: --pp must be >= 1, got 0"
//   GptMemoryEstimate m = estimate_gpt_memory(config, 1);
//   preflight(config, /*mpi=*/false, 1);                 // Error: "gpt: --save=/tmp: ..."
//   m.str();   // "model state 6.1 MiB (ZeRO 0 ...), activations 48.0 MiB, ..."
#pragma once

#include <cstdint>
#include <string>

#include "models/gpt/train.h"

namespace tessera::gpt {

// Throws tessera::Error naming the first flag out of range.
void validate_train_config(const GptTrainConfig& config);

// Bytes of tensor memory (what the process's allocator hands out) at the step's peak.
struct GptMemoryEstimate {
  int ranks_in_process = 1;   // threads-backend ranks share the process; mpirun: 1
  double model_state = 0;     // per rank: parameters, gradients, AdamW state (ZeRO formula)
  double activations = 0;     // per rank: what backward keeps, for the micro-batches in flight
  double logits = 0;          // per rank: [tokens, vocab] logits and their gradient
  double per_rank() const { return model_state + activations + logits; }
  double total() const { return ranks_in_process * per_rank(); }
  std::string str() const;
};

// `ranks_in_process`: how many ranks this process runs (the threads backend: all of them).
// f32 on the CPU path (bf16/f16 keep f32 master weights and most activations' f32 copies,
// so the same figure bounds them); within about 25% of the measured peak for the layouts
// //tests/models:gpt_memory_test checks.
GptMemoryEstimate estimate_gpt_memory(const GptTrainConfig& config, int ranks_in_process);

// Everything train_gpt can know to fail before any work: the output paths (--save,
// --metrics; on the process that writes them, rank 0 under mpirun) and the predicted memory
// against --memory_limit or the machine's available memory (mpirun's processes on one node
// share it). `ranks_here`: the ranks this process runs. Returns the prediction.
GptMemoryEstimate preflight(const GptTrainConfig& config, bool mpi, int ranks_here);

}  // namespace tessera::gpt
