// bazel run //models:mnist -- [--model=mlp|cnn] [--epochs=E] [--batch=B] [--lr=LR]
//     [--precision=f32|bf16|f16] [--save=PATH] [--resume=PATH] [--metrics=PATH] ...
// Trains a Fashion-MNIST classifier and prints the final test accuracy (--help lists all).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "models/common/flags.h"
#include "models/mnist/train.h"
#include "tensor/error.h"

namespace {

// `bazel run` starts the program in its runfiles tree; relative paths given on the command
// line mean the directory the user ran bazel from (BUILD_WORKING_DIRECTORY).
std::string from_user_dir(const std::string& path) {
  const char* dir = std::getenv("BUILD_WORKING_DIRECTORY");
  if (path.empty() || path[0] == '/' || dir == nullptr) return path;
  return std::string(dir) + "/" + path;
}

}  // namespace

int main(int argc, char** argv) {
  tessera::mnist::MnistConfig d;  // defaults
  tessera::models::Flags f(
      "mnist", "Trains an MLP or CNN classifier on Fashion-MNIST and reports test accuracy.");
  auto& model = f.add("model", d.model, "mlp or cnn");
  auto& epochs = f.add("epochs", d.epochs, "passes over the training set (0: 15 for mlp, 8 for cnn)");
  auto& batch = f.add("batch", d.batch, "batch size");
  auto& lr = f.add("lr", d.lr, "peak learning rate (AdamW, warmup then cosine decay)");
  auto& weight_decay = f.add("weight_decay", d.weight_decay, "AdamW decoupled weight decay (not on biases)");
  auto& warmup = f.add("warmup", d.warmup, "linear warmup steps");
  auto& clip = f.add("clip", d.clip, "max global gradient norm (0: off)");
  auto& precision = f.add("precision", d.precision, "f32, bf16 or f16 (mixed precision; f16 scales the loss)");
  auto& data = f.add("data", std::string(), "directory of the IDX files (default /usr/share/datasets/fashion-mnist)");
  auto& save = f.add("save", d.save, "write a checkpoint here at the end (PATH and PATH's .state.safetensors)");
  auto& resume = f.add("resume", d.resume, "continue from this checkpoint");
  auto& metrics = f.add("metrics", d.metrics, "append JSON-lines metrics here (for tools/plot_metrics.py)");
  auto& seed = f.add("seed", d.seed, "seed of initialisation and shuffling");
  auto& threads = f.add("threads", d.threads, "kernel threads (0: all cores)");
  auto& max_steps = f.add("max_steps", d.max_steps, "stop after this many steps in all (0: run every epoch)");
  auto& train_limit = f.add("train_limit", d.train_limit, "use only the first N training images (0: all)");
  auto& test_limit = f.add("test_limit", d.test_limit, "evaluate on the first N test images (0: all)");
  auto& log_every = f.add("log_every", d.log_every, "steps between metrics lines");
  auto& quiet = f.add("quiet", false, "no progress output");
  try {
    f.parse(argc, argv);
    tessera::mnist::MnistConfig c;
    c.model = model;
    c.epochs = epochs;
    c.batch = batch;
    c.lr = lr;
    c.weight_decay = weight_decay;
    c.warmup = warmup;
    c.clip = clip;
    c.precision = precision;
    c.data_dir = from_user_dir(data);
    c.save = from_user_dir(save);
    c.resume = from_user_dir(resume);
    c.metrics = from_user_dir(metrics);
    c.seed = seed;
    c.threads = threads;
    c.max_steps = max_steps;
    c.train_limit = train_limit;
    c.test_limit = test_limit;
    c.log_every = log_every;
    c.verbose = !quiet;
    const tessera::mnist::MnistResult r = tessera::mnist::train_mnist(c);
    if (quiet) std::printf("test accuracy %.4f\n", r.test_accuracy);
  } catch (const tessera::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
