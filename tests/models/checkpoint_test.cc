// Training checkpoints (models/common/checkpoint.h): the previous pair kept until the new
// pair is complete, loading the newest complete pair (with the reason when it falls back),
// stale temporary files removed, non-finite weights refused with the files left as they
// were, and the up-front path check. The kill -9 at each step of a save is in
// fault_injection_test.sh; this suite builds the same file states directly.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>

#include "models/common/checkpoint.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "optim/adamw.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"
#include "tests/testing.h"

namespace tessera::models {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

std::string temp_dir() { return testing::temp_dir("checkpoint_test"); }

std::string fresh_dir(const std::string& name) {
  const std::string dir = temp_dir() + "/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A model, an optimizer with state, and a scaler: what a training loop saves.
struct Run {
  nn::Linear model{3, 2};
  optim::AdamW opt{model.parameters(), {.lr = 0.1}};
  optim::DynamicLossScaler scaler{{.enabled = false}};

  Run() {
    NoGradGuard no_grad;
    model.weight.copy_(Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
    model.bias.copy_(Tensor::from_vector<float>({0.5f, -0.5f}, {2}));
  }
  // One AdamW step, so the state is not trivial; the weights then differ per step.
  void step() {
    opt.zero_grad();
    sum(mul(model.forward(ones({4, 3})), model.forward(ones({4, 3})))).backward();
    opt.step();
  }
  void save(const std::string& path, int64_t step_count) {
    TrainingState s;
    s.step = step_count;
    s.info = {{"model", "linear"}};
    save_checkpoint(path, model, opt, scaler, s);
  }
  std::vector<float> weights() const { return model.weight.to_vector<float>(); }
};

TEST_CASE("a save keeps the previous checkpoint; loading picks the newest") {
  const std::string dir = fresh_dir("newest");
  const std::string path = dir + "/run.safetensors";
  CHECK(state_path(path) == dir + "/run.state.safetensors");
  CHECK(previous_path(path) == dir + "/run.prev.safetensors");
  CHECK(state_path(previous_path(path)) == dir + "/run.prev.state.safetensors");
  CHECK(previous_path(dir + "/ckpt") == dir + "/ckpt.prev");

  Run a;
  a.step();
  a.save(path, 1);
  CHECK(fs::exists(path));
  CHECK(fs::exists(state_path(path)));
  CHECK_FALSE(fs::exists(previous_path(path)));  // nothing to keep before the first save
  const std::vector<float> w1 = a.weights();
  a.step();
  a.save(path, 2);
  const std::vector<float> w2 = a.weights();
  CHECK(w1 != w2);
  CHECK(fs::exists(previous_path(path)));
  CHECK(fs::exists(state_path(previous_path(path))));
  // Exactly the four files: no temporary left behind.
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    ++files;
    CHECK_MESSAGE(e.path().string().find(".tmp.") == std::string::npos, e.path());
  }
  CHECK(files == 4);

  Run b;
  const TrainingState s = load_checkpoint(path, b.model, b.opt, b.scaler);
  CHECK(s.step == 2);
  CHECK(s.loaded_from == path);
  CHECK(s.fallback_reason.empty());
  CHECK(s.info.at("model") == "linear");
  CHECK(b.weights() == w2);
  // The previous pair is itself a complete checkpoint.
  Run c;
  CHECK(load_checkpoint(previous_path(path), c.model, c.opt, c.scaler).step == 1);
  CHECK(c.weights() == w1);
}

TEST_CASE("an interrupted save falls back to the newest complete checkpoint, saying why") {
  const std::string dir = fresh_dir("interrupted");
  const std::string path = dir + "/run.safetensors";
  Run a;
  a.step();
  a.save(path, 1);
  a.step();
  a.save(path, 2);
  const std::vector<float> w2 = a.weights();
  // What a kill between the state's and the model's rename of a third save leaves: the
  // current pair kept as the previous pair, then the new state file in place, the old model.
  fs::copy_file(path, previous_path(path), fs::copy_options::overwrite_existing);
  fs::copy_file(state_path(path), state_path(previous_path(path)),
                fs::copy_options::overwrite_existing);
  Run other;
  other.step();
  other.save(dir + "/other.safetensors", 3);
  fs::copy_file(dir + "/other.state.safetensors", state_path(path),
                fs::copy_options::overwrite_existing);

  Run b;
  const TrainingState s = load_checkpoint(path, b.model, b.opt, b.scaler);
  CHECK(s.step == 2);
  CHECK(b.weights() == w2);
  CHECK(s.loaded_from == path);  // this model file, with the previous pair's state file
  CHECK(s.fallback_reason.find("not one complete checkpoint") != std::string::npos);
  CHECK(s.fallback_reason.find(state_path(previous_path(path))) != std::string::npos);

  // The model file missing too (a save that renames instead of linking): the previous pair.
  fs::remove(path);
  Run c;
  const TrainingState t = load_checkpoint(path, c.model, c.opt, c.scaler);
  CHECK(t.step == 2);
  CHECK(t.loaded_from == previous_path(path));
  CHECK(c.weights() == w2);

  // The next save repairs the set: its pair is complete and becomes the newest.
  c.step();
  c.save(path, 3);
  Run d;
  const TrainingState u = load_checkpoint(path, d.model, d.opt, d.scaler);
  CHECK(u.step == 3);
  CHECK(u.fallback_reason.empty());
  CHECK(d.weights() == c.weights());
}

TEST_CASE("no complete checkpoint: the error names every file and what it holds") {
  const std::string dir = fresh_dir("none");
  const std::string path = dir + "/run.safetensors";
  std::string msg = error_of([&] {
    Run r;
    load_checkpoint(path, r.model, r.opt, r.scaler);
  });
  CHECK(msg.find("no complete checkpoint at " + path) != std::string::npos);
  CHECK(msg.find(path + " (missing)") != std::string::npos);
  CHECK(msg.find(state_path(previous_path(path)) + " (missing)") != std::string::npos);

  Run a;
  a.save(path, 1);
  Run other;
  other.save(dir + "/other.safetensors", 7);
  fs::copy_file(dir + "/other.state.safetensors", state_path(path),
                fs::copy_options::overwrite_existing);
  std::ofstream(previous_path(path)) << "not a safetensors file";
  msg = error_of([&] {
    Run r;
    load_checkpoint(path, r.model, r.opt, r.scaler);
  });
  CHECK(msg.find("no complete checkpoint") != std::string::npos);
  CHECK(msg.find("step 1") != std::string::npos);
  CHECK(msg.find("step 7") != std::string::npos);
  CHECK(msg.find(previous_path(path) + " (load_safetensors") != std::string::npos);
}

TEST_CASE("a new run saving over an old one's path is the newest, whatever its step") {
  const std::string dir = fresh_dir("generation");
  const std::string path = dir + "/run.safetensors";
  Run old_run;
  old_run.save(path, 100);
  old_run.step();
  old_run.save(path, 200);
  Run fresh;
  fresh.step();
  fresh.step();
  fresh.save(path, 5);
  Run b;
  const TrainingState s = load_checkpoint(path, b.model, b.opt, b.scaler);
  CHECK(s.step == 5);
  CHECK(b.weights() == fresh.weights());
  CHECK(nn::read_safetensors_metadata(path).at("generation") == "3");
}

TEST_CASE("stale temporary files of a killed save are removed by the next save") {
  const std::string dir = fresh_dir("stale");
  const std::string path = dir + "/run.safetensors";
  // A pid that surely is dead: a child that has exited and been reaped.
  const pid_t child = fork();
  if (child == 0) _exit(0);
  REQUIRE(child > 0);
  REQUIRE(waitpid(child, nullptr, 0) == child);
  const std::string dead = std::to_string(child);
  for (const std::string& f : {path + ".tmp." + dead, state_path(path) + ".tmp." + dead,
                               previous_path(path) + ".tmp." + dead}) {
    std::ofstream(f) << "partial";
  }
  const std::string live = path + ".tmp.1";  // pid 1 is alive: maybe someone else's save
  const std::string unrelated = dir + "/other.safetensors.tmp." + dead;
  std::ofstream(live) << "x";
  std::ofstream(unrelated) << "x";
  Run a;
  a.save(path, 1);
  CHECK_FALSE(fs::exists(path + ".tmp." + dead));
  CHECK_FALSE(fs::exists(state_path(path) + ".tmp." + dead));
  CHECK_FALSE(fs::exists(previous_path(path) + ".tmp." + dead));
  CHECK(fs::exists(live));
  CHECK(fs::exists(unrelated));
}

TEST_CASE("NaN or inf weights are never written; the files already there stay") {
  const std::string dir = fresh_dir("nonfinite");
  const std::string path = dir + "/run.safetensors";
  Run a;
  a.save(path, 1);
  a.step();
  a.save(path, 2);
  const std::string model_bytes = bytes_of(path), state_bytes = bytes_of(state_path(path)),
                    prev_bytes = bytes_of(previous_path(path));
  {
    NoGradGuard no_grad;
    a.model.bias.copy_(Tensor::from_vector<float>({1.0f, std::nanf("")}, {2}));
  }
  std::string msg = error_of([&] { a.save(path, 3); });
  CHECK(msg.find("refusing to write " + path) != std::string::npos);
  CHECK(msg.find("weight 'bias'") != std::string::npos);
  CHECK(bytes_of(path) == model_bytes);
  CHECK(bytes_of(state_path(path)) == state_bytes);
  CHECK(bytes_of(previous_path(path)) == prev_bytes);
  {
    NoGradGuard no_grad;
    a.model.bias.copy_(Tensor::from_vector<float>({1.0f, INFINITY}, {2}));
  }
  CHECK(error_of([&] { a.save(path, 3); }).find("NaN or inf") != std::string::npos);
  for (const auto& e : fs::directory_iterator(dir)) {
    CHECK_MESSAGE(e.path().string().find(".tmp.") == std::string::npos, e.path());
  }
}

TEST_CASE("check_checkpoint_path refuses what a save would fail on, before any work") {
  const std::string dir = fresh_dir("paths");
  CHECK(error_of([&] { check_checkpoint_path(dir, "gpt: --save"); })
            .find("gpt: --save=" + dir + ": '" + dir + "' is a directory") != std::string::npos);
  CHECK(error_of([&] { check_checkpoint_path(dir + "/", "gpt: --save"); })
            .find("names a directory") != std::string::npos);
  CHECK(error_of([&] { check_checkpoint_path(dir + "/missing/x.safetensors", "--save"); })
            .find("directory '" + dir + "/missing' does not exist") != std::string::npos);
  std::ofstream(dir + "/file") << "x";
  CHECK(error_of([&] { check_checkpoint_path(dir + "/file/x.safetensors", "--save"); })
            .find("'" + dir + "/file' is not a directory") != std::string::npos);
  fs::create_directories(dir + "/x.state.safetensors");
  CHECK(error_of([&] { check_checkpoint_path(dir + "/x.safetensors", "--save"); })
            .find("x.state.safetensors' is a directory") != std::string::npos);
  CHECK(error_of([&] { check_checkpoint_path("", "--save"); }).find("empty") !=
        std::string::npos);
  check_checkpoint_path(dir + "/ok.safetensors", "--save");  // fine, and leaves nothing
  CHECK_FALSE(fs::exists(dir + "/ok.safetensors"));
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++files;
  CHECK(files == 2);  // "file" and the x.state.safetensors directory
}

}  // namespace
}  // namespace tessera::models
