#include "models/common/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <random>
#include <system_error>
#include <vector>

#include "models/common/fault.h"
#include "nn/safetensors.h"
#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::models {
namespace {

constexpr const char* kOptimPrefix = "optimizer.";
constexpr const char* kScalerPrefix = "scaler.";
const std::string kExt = ".safetensors";

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

Tensor i64_scalar(uint64_t v) {
  return Tensor::from_vector<int64_t>({static_cast<int64_t>(v)}, {});
}

int64_t read_i64(const nn::SafetensorsFile& f, const std::string& key, const std::string& path) {
  auto it = f.tensors.find(key);
  TS_CHECK(it != f.tensors.end(), "load_checkpoint: {} has no entry '{}'", path, key);
  TS_CHECK(it->second.dtype() == DType::i64 && it->second.numel() == 1,
           "load_checkpoint: {} entry '{}' should be one i64, got {} {}", path, key,
           it->second.dtype(), shape_str(it->second.shape()));
  return it->second.item<int64_t>();
}

std::map<std::string, Tensor> with_prefix(const std::map<std::string, Tensor>& all,
                                          const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (const auto& [k, v] : all) {
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  }
  return out;
}

std::string new_checkpoint_id() {
  std::random_device rd;
  const uint64_t t = std::chrono::steady_clock::now().time_since_epoch().count();
  return fmt::format("{:016x}", (static_cast<uint64_t>(rd()) << 32 ^ rd()) ^ t);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string dir_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: the files themselves are synced
  ::fsync(fd);
  ::close(fd);
}

void rename_or_fail(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    fail("save_checkpoint: cannot rename '{}' to '{}': {}", from, to, errno_text(errno));
  }
}

// `to` becomes another name of `from`'s file (replacing `to` atomically); where the file
// system has no hard links, `from` is renamed instead (the loader copes with either).
void keep_as(const std::string& from, const std::string& to) {
  struct stat a, b;
  if (::stat(from.c_str(), &a) == 0 && ::stat(to.c_str(), &b) == 0 && a.st_dev == b.st_dev &&
      a.st_ino == b.st_ino) {
    return;  // already the same file (a save interrupted right after keeping it)
  }
  const std::string tmp = fmt::format("{}.tmp.{}", to, ::getpid());
  ::unlink(tmp.c_str());
  if (::link(from.c_str(), tmp.c_str()) == 0) {
    rename_or_fail(tmp, to);
    ::unlink(tmp.c_str());  // rename() between two links of one file leaves both names
    return;
  }
  const int err = errno;
  if (err != EPERM && err != ENOTSUP && err != EOPNOTSUPP && err != EMLINK) {
    fail("save_checkpoint: cannot keep '{}' as '{}': {}", from, to, errno_text(err));
  }
  rename_or_fail(from, to);
}

// Removes "<name>.tmp.<pid>" files of the given names whose writer is gone (a killed save)
// or is this process; a live process's files are left alone.
void remove_stale_temporaries(const std::string& dir, const std::vector<std::string>& names) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  std::vector<std::string> stale;
  while (const dirent* e = ::readdir(d)) {
    const std::string file = e->d_name;
    for (const std::string& name : names) {
      const std::string prefix = name + ".tmp.";
      if (file.size() <= prefix.size() || file.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string pid_text = file.substr(prefix.size());
      if (pid_text.find_first_not_of("0123456789") != std::string::npos || pid_text.size() > 9) {
        continue;
      }
      const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
      if (pid == ::getpid() || (::kill(pid, 0) != 0 && errno == ESRCH)) stale.push_back(file);
    }
  }
  ::closedir(d);
  for (const std::string& file : stale) ::unlink((dir + "/" + file).c_str());
}

template <typename T>
bool all_finite(const void* data, int64_t n) {
  const T* p = static_cast<const T*>(data);
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= std::isfinite(p[i]);  // no early exit: vectorises
  return ok;
}

// Error naming the first floating tensor holding NaN or inf: a diverged run must not replace
// a good checkpoint.
void check_finite(const std::string& path, const std::string& what,
                  const std::map<std::string, Tensor>& tensors) {
  for (const auto& [name, t] : tensors) {
    if (!is_floating(t.dtype()) || t.numel() == 0) continue;
    TS_CHECK(all_values_finite(t),
             "save_checkpoint: refusing to write {}: {} '{}' {} holds NaN or inf (the run "
             "diverged); the files already there are kept",
             path, what, name, shape_str(t.shape()));
  }
}

// What a checkpoint file's header says (read without its tensors).
struct FileInfo {
  std::string path;
  bool present = false;
  std::string id;       // empty when unreadable or not a checkpoint
  int64_t step = -1;
  int64_t generation = 0;  // 1 + the highest generation present when it was saved
  std::string problem;  // why it is not usable
};

FileInfo inspect(const std::string& path) {
  FileInfo f;
  f.path = path;
  if (!exists(path)) {
    f.problem = "missing";
    return f;
  }
  f.present = true;
  try {
    const std::map<std::string, std::string> meta = nn::read_safetensors_metadata(path);
    auto id = meta.find("checkpoint_id");
    auto step = meta.find("step");
    if (id == meta.end()) {
      f.problem = "not a Tessera checkpoint (no checkpoint_id)";
      return f;
    }
    f.id = id->second;
    auto number = [](const std::string& text, int64_t fallback) {
      try {
        return static_cast<int64_t>(std::stoll(text));
      } catch (const std::exception&) {
        return fallback;
      }
    };
    if (step != meta.end()) f.step = number(step->second, -1);
    auto gen = meta.find("generation");
    if (gen != meta.end()) f.generation = number(gen->second, 0);
  } catch (const Error& e) {
    f.problem = e.what();
  }
  return f;
}

std::string describe(const FileInfo& f) {
  if (!f.id.empty()) {
    return fmt::format("{} (checkpoint id {}, step {}, save {})", f.path, f.id, f.step,
                       f.generation);
  }
  return fmt::format("{} ({})", f.path, f.problem);
}

// The newest complete (model, state) pair among the path's files and the previous pair's.
struct Choice {
  FileInfo model, state;
  std::string reason;  // set when the pair is not (path, state_path(path))
};

Choice choose(const std::string& path) {
  const FileInfo models[] = {inspect(path), inspect(previous_path(path))};
  const FileInfo states[] = {inspect(state_path(path)), inspect(state_path(previous_path(path)))};
  std::optional<Choice> best;
  for (int m = 0; m < 2; ++m) {
    for (int s = 0; s < 2; ++s) {
      if (models[m].id.empty() || models[m].id != states[s].id) continue;
      // The newest save wins (not the highest step: a new run may save over an old one's
      // path); on a tie the files at `path` do.
      if (!best || models[m].generation > best->model.generation) {
        best = Choice{models[m], states[s], ""};
      }
    }
  }
  std::string found = fmt::format("{}, {}, {}, {}", describe(models[0]), describe(states[0]),
                                  describe(models[1]), describe(states[1]));
  if (!best) {
    fail("load_checkpoint: no complete checkpoint at {}: a checkpoint is a model file and a "
         "state file with the same checkpoint id; found {}",
         path, found);
  }
  if (best->model.path != path || best->state.path != state_path(path)) {
    best->reason = fmt::format(
        "{} and {} are not one complete checkpoint (a save was interrupted); loaded the newest "
        "complete one, {} with {}",
        describe(models[0]), describe(states[0]), best->model.path, best->state.path);
  }
  return *best;
}

}  // namespace

// Whether every element is finite. f32/f64 on the CPU (what checkpoints hold) are read in
// place; anything else goes through ops: x - x is 0 for finite x and NaN otherwise, so the
// sum is finite iff every element is.
bool all_values_finite(const Tensor& t) {
  if (t.device().is_cpu() && t.is_contiguous() && t.dtype() == DType::f32) {
    return all_finite<float>(t.raw_data(), t.numel());
  }
  if (t.device().is_cpu() && t.is_contiguous() && t.dtype() == DType::f64) {
    return all_finite<double>(t.raw_data(), t.numel());
  }
  NoGradGuard no_grad;
  return std::isfinite(sum(sub(t, t)).item<double>());
}


std::string state_path(const std::string& path) {
  if (ends_with(path, kExt)) return path.substr(0, path.size() - kExt.size()) + ".state" + kExt;
  return path + ".state" + kExt;
}

std::string previous_path(const std::string& path) {
  if (ends_with(path, kExt)) return path.substr(0, path.size() - kExt.size()) + ".prev" + kExt;
  return path + ".prev";
}

void check_checkpoint_path(const std::string& path, const std::string& flag) {
  TS_CHECK(!path.empty(), "{}: the path is empty", flag);
  TS_CHECK(path.back() != '/', "{}={} names a directory; give a file path such as {}model{}", flag,
           path, path, kExt);
  struct stat st;
  const std::string dir = dir_of(path);
  if (::stat(dir.c_str(), &st) != 0) {
    fail("{}={}: directory '{}' {}", flag, path, dir,
         errno == ENOENT ? std::string("does not exist") : errno_text(errno));
  }
  TS_CHECK(S_ISDIR(st.st_mode), "{}={}: '{}' is not a directory", flag, path, dir);
  for (const std::string& p : {path, state_path(path), previous_path(path),
                               state_path(previous_path(path))}) {
    if (::stat(p.c_str(), &st) != 0) continue;
    TS_CHECK(!S_ISDIR(st.st_mode),
             "{}={}: '{}' is a directory; give a file path such as {}/model{}", flag, path, p,
             p, kExt);
    TS_CHECK(S_ISREG(st.st_mode), "{}={}: '{}' exists and is not a regular file", flag, path, p);
  }
  // The probe: what the save will do first, create a file beside the checkpoint.
  const std::string probe = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    fail("{}={}: cannot create a file in '{}': {}", flag, path, dir, errno_text(errno));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

void save_checkpoint(const std::string& path, const nn::Module& model,
                     const optim::Optimizer& optimizer, const optim::DynamicLossScaler& scaler,
                     const TrainingState& state) {
  save_checkpoint(path, model.state_dict(), optimizer.state_dict(), scaler, state);
}

void save_checkpoint(const std::string& path, const nn::StateDict& model,
                     const optim::Optimizer::StateDict& optimizer,
                     const optim::DynamicLossScaler& scaler, const TrainingState& state) {
  // Written from host memory: a device run's tensors are copied over (loading copies back).
  auto host = [](const Tensor& t) { return t.device().is_cpu() ? t : t.to(kCPU); };
  std::map<std::string, Tensor> weights, extra;
  for (const auto& [k, v] : model) weights[k] = host(v);
  for (const auto& [k, v] : optimizer) extra[kOptimPrefix + k] = host(v);
  check_finite(path, "weight", weights);
  check_finite(path, "optimizer state", extra);
  for (const auto& [k, v] : scaler.state_dict()) extra[kScalerPrefix + k] = v;
  extra["progress.step"] = i64_scalar(state.step);
  extra["progress.epoch"] = i64_scalar(state.epoch);
  extra["progress.batch_index"] = i64_scalar(state.batch_index);
  extra["rng.seed"] = i64_scalar(state.rng_seed);
  extra["rng.offset"] = i64_scalar(state.rng_offset);

  const std::string spath = state_path(path), prev = previous_path(path),
                    sprev = state_path(prev), dir = dir_of(path);
  remove_stale_temporaries(dir, {base_of(path), base_of(spath), base_of(prev), base_of(sprev)});
  int64_t generation = 0;
  for (const std::string& p : {path, spath, prev, sprev}) {
    generation = std::max(generation, inspect(p).generation);
  }
  const std::string id = new_checkpoint_id();
  std::map<std::string, std::string> meta = {{"format", "tessera-checkpoint"},
                                             {"checkpoint_id", id},
                                             {"step", std::to_string(state.step)},
                                             {"generation", std::to_string(generation + 1)}};
  std::map<std::string, std::string> model_meta = meta;
  for (const auto& [k, v] : state.info) model_meta["info." + k] = v;

  // 1. Both new files, complete and fsync'd, under temporary names.
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  const std::string stmp = fmt::format("{}.tmp.{}", spath, ::getpid());
  try {
    nn::write_safetensors_file(stmp, extra, meta);
    nn::write_safetensors_file(tmp, weights, model_meta);
  } catch (...) {
    ::unlink(stmp.c_str());
    throw;
  }
  fault_point("checkpoint.staged");
  try {
    // 2. The current pair, when complete, becomes the previous pair (the previous pair is
    // replaced only by a complete one, so one complete pair always survives).
    const FileInfo cur_model = inspect(path), cur_state = inspect(spath);
    if (!cur_model.id.empty() && cur_model.id == cur_state.id) {
      keep_as(spath, sprev);
      fault_point("checkpoint.previous_state_kept");
      keep_as(path, prev);
      fault_point("checkpoint.previous_kept");
    }
    // 3. The new pair, state first: until the model's rename the previous pair (or the
    // current one, unchanged) is the newest complete checkpoint.
    rename_or_fail(stmp, spath);
    fault_point("checkpoint.state_renamed");
    rename_or_fail(tmp, path);
  } catch (...) {
    ::unlink(stmp.c_str());
    ::unlink(tmp.c_str());
    throw;
  }
  sync_directory(dir);
  fault_point("checkpoint.committed");
}

TrainingState load_checkpoint(const std::string& path, nn::Module& model,
                              optim::Optimizer& optimizer, optim::DynamicLossScaler& scaler) {
  return load_checkpoint(
      path,
      [&](const nn::StateDict& weights, const optim::Optimizer::StateDict& optim_state) {
        model.load_state_dict(weights);
        optimizer.load_state_dict(optim_state);
      },
      scaler);
}

TrainingState load_checkpoint(const std::string& path, const ApplyCheckpoint& apply,
                              optim::DynamicLossScaler& scaler) {
  const Choice choice = choose(path);
  const std::string& mpath = choice.model.path;
  const std::string& spath = choice.state.path;
  const nn::SafetensorsFile weights = nn::load_safetensors(mpath);
  const nn::SafetensorsFile extra = nn::load_safetensors(spath);
  auto id_of = [](const nn::SafetensorsFile& f) {
    auto it = f.metadata.find("checkpoint_id");
    return it == f.metadata.end() ? std::string("(none)") : it->second;
  };
  // The headers were read a moment ago; this catches files replaced in between.
  TS_CHECK(id_of(weights) == id_of(extra) && id_of(weights) != "(none)",
           "load_checkpoint: {} (checkpoint id {}) and {} (checkpoint id {}) are not from the "
           "same save; they changed while being read",
           mpath, id_of(weights), spath, id_of(extra));
  try {
    apply(weights.tensors, with_prefix(extra.tensors, kOptimPrefix));
    scaler.load_state_dict(with_prefix(extra.tensors, kScalerPrefix));
  } catch (const Error& e) {
    fail("load_checkpoint: {} does not fit this model or optimizer: {}", mpath, e.what());
  }
  TrainingState s;
  s.step = read_i64(extra, "progress.step", spath);
  s.epoch = read_i64(extra, "progress.epoch", spath);
  s.batch_index = read_i64(extra, "progress.batch_index", spath);
  s.rng_seed = static_cast<uint64_t>(read_i64(extra, "rng.seed", spath));
  s.rng_offset = static_cast<uint64_t>(read_i64(extra, "rng.offset", spath));
  for (const auto& [k, v] : weights.metadata) {
    if (k.rfind("info.", 0) == 0) s.info[k.substr(5)] = v;
  }
  s.loaded_from = mpath;
  s.fallback_reason = choice.reason;
  return s;
}

}  // namespace tessera::models
