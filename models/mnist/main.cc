// bazel run //models:mnist -- [--model=mlp|cnn] [--epochs=E] [--batch=B] [--lr=LR]
//     [--precision=f32|bf16|f16] [--save=PATH] [--resume=PATH] [--metrics=PATH] ...
//   bazel run //models:mnist -- --dp=4 [--zero=1] [--compress=powersgd|onebit_adam]
//   mpirun -np 2 bazel-bin/models/mnist/mnist --dp=2
//   bazel run --config=cuda //models:mnist -- --model=cnn --device=cuda
// Trains a Fashion-MNIST classifier and prints the final test accuracy (--help lists all).
// Any failure is one "error: ..." line and exit code 1; SIGTERM/SIGINT saves and exits
// 128 + the signal.
#include <cstdio>
#include <string>

#include "models/common/flags.h"
#include "models/common/run_control.h"
#include "models/mnist/train.h"

int main(int argc, char** argv) {
  tessera::mnist::MnistConfig c;
  tessera::models::Flags f(
      "mnist", "Trains an MLP or CNN classifier on Fashion-MNIST and reports test accuracy.");
  f.bind("model", c.model, "mlp or cnn");
  f.bind("epochs", c.epochs, "passes over the training set (0: 15 for mlp, 8 for cnn)");
  f.bind("batch", c.batch, "batch size");
  f.bind("lr", c.lr, "peak learning rate (AdamW, warmup then cosine decay)");
  f.bind("weight_decay", c.weight_decay, "AdamW decoupled weight decay (not on biases)");
  f.bind("warmup", c.warmup, "linear warmup steps");
  f.bind("optimizer", c.optimizer.name,
         "adamw, adamw8bit (8-bit block-wise moments), adafactor (factored second moments) or sgd");
  f.bind("adafactor_mode", c.optimizer.adafactor_mode,
         "Adafactor's reference: hf (transformers/fairseq), torch or optax");
  f.bind("adafactor_beta1", c.optimizer.adafactor_beta1, "Adafactor's first moment (0: none)");
  f.bind("momentum", c.optimizer.momentum, "SGD momentum");
  f.bind("clip", c.clip, "max global gradient norm (0: off)");
  f.bind("precision", c.precision, "f32, bf16 or f16 (mixed precision; f16 scales the loss)");
  f.bind("data", c.data_dir, "directory of the IDX files (default /usr/share/datasets/fashion-mnist)");
  f.bind("save", c.save, "write a checkpoint here at the end (PATH and PATH's .state.safetensors)");
  f.bind("resume", c.resume, "continue from this checkpoint");
  f.bind("metrics", c.metrics, "append JSON-lines metrics here (for tools/plot_metrics.py)");
  f.bind("seed", c.seed, "seed of initialisation and shuffling");
  f.bind("threads", c.threads, "kernel threads (0: all cores)");
  f.bind("device", c.device, "cpu, cuda or cuda:N (needs a --config=cuda build)");
  f.bind("max_steps", c.max_steps, "stop after this many steps in all (0: run every epoch)");
  f.bind("train_limit", c.train_limit, "use only the first N training images (0: all)");
  f.bind("test_limit", c.test_limit, "evaluate on the first N test images (0: all)");
  f.bind("log_every", c.log_every, "steps between metrics lines");
  f.bind("dp", c.dp, "data-parallel ranks (threads here; under mpirun it must equal the process count)");
  f.bind("zero", c.zero, "ZeRO stage: 0 all-reduce, 1 optimizer state, 2 + gradients, 3 + params");
  tessera::models::bind_compress_flags(f, c.compress);
  tessera::models::bind_offload_flags(f, c.offload);
  f.bind("nonfinite", c.nonfinite,
         "a step with a NaN/inf loss or gradient norm: error (stop, keep the last "
         "checkpoint) or skip (drop it)");
  std::string memory_limit = "0";
  f.bind("memory_limit", memory_limit, "tensor memory this process may use, e.g. 2G (0: no cap)");
  bool quiet = false;
  f.bind("quiet", quiet, "no progress output");
  return tessera::models::run_main([&] {
    f.parse(argc, argv);
    c.verbose = !quiet;
    c.memory_limit = tessera::models::parse_bytes(memory_limit, "mnist: --memory_limit");
    for (std::string* path : {&c.data_dir, &c.save, &c.resume, &c.metrics, &c.offload.dir}) {
      *path = tessera::models::from_user_dir(*path);
    }
    const tessera::mnist::MnistResult r = tessera::mnist::train_mnist(c);
    if (quiet) std::printf("test accuracy %.4f\n", r.test_accuracy);
  });
}
