// Training and evaluating the Fashion-MNIST classifiers (models/mnist/model.h): the loop
// behind `bazel run //models:mnist`, callable from tests. AdamW with decoupled weight decay
// (none on biases), linear warmup + cosine decay, optional gradient clipping, f32 / bf16 /
// f16 mixed precision (f16 with dynamic loss scaling), safetensors checkpoints with exact
// resume, JSON-lines metrics and a progress line; on the CPU or a GPU (--device=cuda); data
// parallel over --dp threads or mpirun processes (ZeRO 0-3), with gradient compression.
//
//   MnistConfig config;  config.model = "cnn";  config.epochs = 2;
//   MnistResult r = train_mnist(config);       // r.test_accuracy in [0, 1]
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/common/comm_hooks.h"
#include "models/common/offload_flags.h"
#include "models/common/optimizers.h"

namespace tessera::mnist {

struct MnistConfig {
  std::string model = "mlp";      // mlp | cnn
  int64_t epochs = 0;             // 0: the model's default (kDefaultEpochs)
  int64_t batch = 128;
  double lr = 1e-3;               // peak learning rate
  double min_lr_ratio = 0.05;     // the cosine decays to lr * this
  int64_t warmup = 100;           // linear warmup steps
  double weight_decay = 0.05;
  // adamw | adamw8bit | adafactor | sgd, with their hyper-parameters (models/common/optimizers.h).
  models::OptimizerChoice optimizer = {.name = "adamw"};
  double clip = 0.0;              // max global gradient norm; 0 = no clipping
  std::string precision = "f32";  // f32 | bf16 | f16
  std::string data_dir;           // empty: /usr/share/datasets/fashion-mnist
  // Checkpoints are saved atomically (models/common/checkpoint.h: the previous one is kept
  // until the new one is complete); SIGTERM/SIGINT finishes the step, saves, and stops.
  std::string save;               // checkpoint path written at the end (and on --max_steps)
  std::string resume;             // checkpoint path to continue from (the newest complete)
  std::string metrics;            // JSON-lines file (appended to when resuming)
  int64_t seed = 0;               // initialisation, shuffling, dropout
  int64_t threads = 0;            // kernel threads; 0: all cores
  // cpu, cuda or cuda:N (a --config=cuda build): the model is moved there after
  // initialisation, batches are built on the CPU and copied over, the test set is copied
  // once, checkpoints are written from CPU copies.
  std::string device = "cpu";
  int64_t max_steps = 0;          // stop after this many steps in total (0: all epochs)
  int64_t train_limit = 0;        // use the first N training images (0: all)
  int64_t test_limit = 0;         // evaluate on the first N test images (0: all)
  int64_t log_every = 50;         // steps between metrics lines
  bool eval_each_epoch = true;
  // A step whose loss or gradient norm (known with --clip, or with skip) is NaN or inf:
  // "error" stops the run before anything more is saved; "skip" drops that step's update
  // (MnistResult::nonfinite_skipped counts them). The rule of models/common/train_loop.h.
  std::string nonfinite = "error";
  int64_t memory_limit = 0;       // bytes the CPU allocator may hand out (0: no cap)
  // Data parallelism: dp ranks (threads; under mpirun the process count), each training on
  // its 1/dp of every batch (batch must divide), gradients averaged over the ranks under
  // ZeRO stage `zero` (parallel/zero.h; 0 is DDP). CPU only.
  int64_t dp = 1;
  int64_t zero = 0;
  // Gradient compression over dp (models/common/comm_hooks.h: powersgd on ZeRO 0-3, or
  // onebit_adam in AdamW's place on ZeRO 0); f32 or bf16. Checkpoints keep each rank's error feedback (a
  // resume needs the same --dp).
  models::CompressChoice compress;
  // Offload under ZeRO (models/common/offload_flags.h): the optimizer (--zero 1-3) and the
  // parameter shards (--zero 3) in host memory or a swap file; the same numbers.
  models::OffloadChoice offload;
  bool verbose = true;            // progress line and summary on stdout
};

struct EpochDefaults {
  int64_t mlp = 15;
  int64_t cnn = 8;
};
inline constexpr EpochDefaults kDefaultEpochs{};

struct MnistResult {
  double test_accuracy = 0.0;  // of the final model, on the (limited) test set
  double test_loss = 0.0;
  int64_t steps = 0;           // total optimizer steps, including those before a resume
  int64_t skipped_steps = 0;   // f16 steps skipped for inf/NaN gradients
  std::vector<double> losses;          // each step's loss, in this run
  std::vector<double> epoch_samples_per_s;  // training throughput per (full) epoch
  double samples_per_s = 0.0;          // over all training steps of this run
  int64_t peak_device_bytes = 0;       // the device allocator's high-water mark (--device)
  int64_t nonfinite_skipped = 0;       // steps skipped by --nonfinite=skip
  // --compress: the last step's gradient elements sent over those of an exact all-reduce.
  double compress_ratio = 1.0;
};

MnistResult train_mnist(const MnistConfig& config);

}  // namespace tessera::mnist
