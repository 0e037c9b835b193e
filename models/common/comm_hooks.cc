#include "models/common/comm_hooks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <vector>

#include "models/common/flags.h"

#include "parallel/comm/comm_log.h"
#include "parallel/onebit_adam.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace tessera::models {
namespace {

// A name as a tensor (its bytes as i64), for the checkpoint to say which hook wrote it.
Tensor name_tensor(const std::string& name) {
  std::vector<int64_t> bytes(name.begin(), name.end());
  return Tensor::from_vector<int64_t>(bytes, {static_cast<int64_t>(bytes.size())});
}

std::string name_of(const Tensor& t) {
  std::string out;
  for (int64_t c : t.to_vector<int64_t>()) out.push_back(static_cast<char>(c));
  return out;
}

// Takes the "comm." entries out of `dict`, keyed without the prefix.
std::map<std::string, Tensor> take_comm_entries(optim::Optimizer::StateDict& dict) {
  std::map<std::string, Tensor> saved;
  for (auto it = dict.begin(); it != dict.end();) {
    if (it->first.starts_with("comm.")) {
      saved[it->first.substr(5)] = it->second;
      it = dict.erase(it);
    } else {
      ++it;
    }
  }
  return saved;
}

// Error naming --compress unless `hook`'s kind wrote `saved` (its "kind" entry).
void check_hook_kind(const char* program, const std::map<std::string, Tensor>& saved,
                     const parallel::CommHook& hook) {
  const std::string kind = saved.count("kind") ? name_of(saved.at("kind")) : "";
  TS_CHECK(kind == hook.name(),
           "{}: the checkpoint's gradient compression state is {}'s, not {}'s: resume with "
           "--compress={}",
           program, kind.empty() ? "an unnamed hook" : kind, hook.name(),
           kind.empty() ? "none" : kind);
}

}  // namespace

void bind_compress_flags(Flags& f, CompressChoice& c) {
  f.bind("compress", c.name,
         "gradient compression over dp: none, powersgd or onebit_adam (1-bit Adam, for AdamW)");
  f.bind("powersgd_rank", c.powersgd_rank, "PowerSGD: the low-rank approximation's rank");
  f.bind("powersgd_start", c.powersgd_start, "PowerSGD: exact steps before compressing");
  f.bind("onebit_freeze", c.onebit_freeze,
         "1-bit Adam: AdamW warm-up steps before the variance freezes (0: 20% of the steps)");
  f.bind("onebit_send", c.onebit_send,
         "1-bit Adam: what is compressed, update (m / (sqrt(v) + eps)) or momentum (m, the "
         "paper's)");
  f.bind("onebit_scale", c.onebit_scale,
         "1-bit Adam: the signs' scale, l1 (mean |x|) or l2 (||x|| / sqrt(n), DeepSpeed's)");
  f.bind("onebit_bound", c.onebit_bound,
         "1-bit Adam: clamp the sent update to the largest |m| / sqrt(v) AdamW can reach");
}

void validate_compress(const char* program, const CompressChoice& c, const std::string& optimizer) {
  require_one_of(program, "compress", c.name, {"none", "powersgd", "onebit_adam"});
  require_at_least(program, "powersgd_rank", c.powersgd_rank, 1);
  require_at_least(program, "powersgd_start", c.powersgd_start, 0);
  require_at_least(program, "onebit_freeze", c.onebit_freeze, 0);
  require_one_of(program, "onebit_send", c.onebit_send, {"update", "momentum"});
  require_one_of(program, "onebit_scale", c.onebit_scale, {"l1", "l2"});
  TS_CHECK(c.name != "onebit_adam" || optimizer == "adamw",
           "{}: --compress=onebit_adam is 1-bit Adam, which replaces AdamW; it needs "
           "--optimizer=adamw (got --optimizer={})",
           program, optimizer);
}

void require_compress_zero(const char* program, const CompressChoice& c, int64_t zero) {
  TS_CHECK(c.name != "onebit_adam" || zero == 0,
           "{}: --compress=onebit_adam keeps whole momenta and variances on every rank and "
           "reduces them itself after the warm-up; ZeRO {} shards the optimizer state: use "
           "--zero 0 (or --compress=powersgd, which composes with ZeRO 1-3)",
           program, zero);
}

std::unique_ptr<optim::Optimizer> make_onebit_adam(const CompressChoice& c,
                                                   std::vector<optim::ParamGroup> groups,
                                                   parallel::Communicator& comm,
                                                   std::shared_ptr<parallel::CommHook> hook,
                                                   double lr, std::pair<double, double> betas,
                                                   double weight_decay, int64_t total_steps) {
  const parallel::OnebitAdamOptions o{
      .lr = lr,
      .betas = betas,
      .weight_decay = weight_decay,
      .freeze_step = c.onebit_freeze > 0 ? c.onebit_freeze : std::max<int64_t>(1, total_steps / 5),
      .precondition = c.onebit_send == "update",
      .scale = parallel::parse_onebit_scale(c.onebit_scale, "--onebit_scale"),
      .bound_update = c.onebit_bound};
  return std::make_unique<parallel::OnebitAdam>(
      std::move(groups), comm, o, std::dynamic_pointer_cast<parallel::OnebitAdamHook>(hook));
}

std::string hook_traffic(const parallel::CommHook& hook) {
  const parallel::CommHook::Traffic t = hook.last_round();
  return fmt::format("  {} sent {} of {} gradient elements ({:.3g}x)", hook.name(), t.sent,
                     t.uncompressed,
                     t.sent > 0 ? static_cast<double>(t.uncompressed) / static_cast<double>(t.sent)
                                : 1.0);
}

std::shared_ptr<parallel::CommHook> make_comm_hook(const char* program, const CompressChoice& c,
                                                   uint64_t seed) {
  if (c.name == "none") return nullptr;
  if (c.name == "powersgd") {
    return std::make_shared<parallel::PowerSgd>(parallel::PowerSgdOptions{
        .rank = c.powersgd_rank, .start_iter = c.powersgd_start, .seed = seed});
  }
  if (c.name == "onebit_adam") return std::make_shared<parallel::OnebitAdamHook>();
  fail("{}: --compress must be none, powersgd or onebit_adam, got '{}'", program, c.name);
}

std::map<std::string, Tensor> gather_hook_state(const parallel::CommHook& hook,
                                                parallel::Communicator& comm, int64_t zero) {
  parallel::CommCause cause("checkpoint comm hook state", parallel::CommKind::control);
  std::map<std::string, Tensor> out;
  for (const auto& [key, v] : hook.state_dict()) {
    Shape shape = v.shape();
    shape.insert(shape.begin(), comm.size());
    const Tensor all = Tensor::empty(shape, v.dtype(), v.device());
    comm.all_gather(all, v.contiguous());
    out["comm." + key] = all;
  }
  out["comm.kind"] = name_tensor(hook.name());
  out["comm.zero"] = Tensor::from_vector<int64_t>({zero}, {});
  return out;
}

void load_hook_state(const char* program, parallel::CommHook* hook, parallel::Communicator* comm,
                     optim::Optimizer::StateDict& dict, int64_t zero) {
  std::map<std::string, Tensor> saved = take_comm_entries(dict);
  if (hook == nullptr || saved.empty()) return;
  TS_CHECK(comm != nullptr, "{}: a comm hook needs a data-parallel group", program);
  check_hook_kind(program, saved, *hook);
  saved.erase("kind");
  TS_CHECK(saved.count("layout") == 0,
           "{}: the checkpoint's gradient compression state was saved per rank by a --pp/--tp "
           "run: resume with its --pp, --dp, --tp and --zero",
           program);
  if (saved.count("zero") != 0) {  // older checkpoints: ZeRO 0, the only stage hooks had
    const int64_t was = saved.at("zero").item<int64_t>();
    TS_CHECK(was == zero,
             "{}: the checkpoint's gradient compression state was saved under --zero {}, whose "
             "buckets differ from --zero {}'s: resume with --zero {}",
             program, was, zero, was);
    saved.erase("zero");
  } else {
    TS_CHECK(zero == 0,
             "{}: the checkpoint's gradient compression state was saved under --zero 0, whose "
             "buckets differ from --zero {}'s: resume with --zero 0",
             program, zero);
  }
  std::map<std::string, Tensor> mine;
  for (const auto& [key, v] : saved) {
    TS_CHECK(v.dim() >= 1 && v.size(0) == comm->size(),
             "{}: the checkpoint holds the gradient compression state of {} data-parallel "
             "ranks ('comm.{}' {}); this run has {}: resume with as many (the error feedback "
             "is per rank)",
             program, v.dim() >= 1 ? v.size(0) : 0, key, shape_str(v.shape()), comm->size());
    mine[key] = v.select(0, comm->rank()).contiguous().clone();
  }
  hook->load_state_dict(mine);
}

std::map<std::string, Tensor> own_hook_state(const parallel::CommHook& hook, int rank,
                                             const std::vector<int64_t>& layout) {
  std::map<std::string, Tensor> out;
  for (const auto& [key, v] : hook.state_dict()) {
    out[fmt::format("comm.r{}.{}", rank, key)] = v.to(kCPU).contiguous();
  }
  if (rank == 0) {
    out["comm.kind"] = name_tensor(hook.name());
    out["comm.layout"] = Tensor::from_vector<int64_t>(layout, {static_cast<int64_t>(layout.size())});
  }
  return out;
}

std::map<std::string, Tensor> world_hook_state(const parallel::CommHook& hook,
                                               parallel::Communicator& world,
                                               const std::vector<int64_t>& layout) {
  parallel::CommCause cause("checkpoint comm hook state", parallel::CommKind::control);
  const std::map<std::string, Tensor> mine = own_hook_state(hook, world.rank(), layout);
  std::map<std::string, Tensor> out;
  for (int r = 0; r < world.size(); ++r) {
    // Rank r's manifest: per entry the name's bytes, the dtype, the rank and the dims.
    std::vector<int64_t> code;
    if (r == world.rank()) {
      for (const auto& [key, v] : mine) {
        code.push_back(static_cast<int64_t>(key.size()));
        code.insert(code.end(), key.begin(), key.end());
        code.push_back(static_cast<int64_t>(v.dtype()));
        code.push_back(v.dim());
        code.insert(code.end(), v.shape().begin(), v.shape().end());
      }
    }
    Tensor length = Tensor::from_vector<int64_t>({static_cast<int64_t>(code.size())}, {1});
    world.broadcast(length, r);
    const int64_t n = length.to_vector<int64_t>()[0];
    Tensor encoded = r == world.rank() ? Tensor::from_vector<int64_t>(code, {n}) : zeros({n}, DType::i64);
    world.broadcast(encoded, r);
    code = encoded.to_vector<int64_t>();
    for (size_t at = 0; at < code.size();) {
      const int64_t len = code.at(at++);
      std::string key;
      for (int64_t c = 0; c < len; ++c) key.push_back(static_cast<char>(code.at(at++)));
      const auto dtype = static_cast<DType>(code.at(at++));
      Shape shape(static_cast<size_t>(code.at(at++)));
      for (int64_t& d : shape) d = code.at(at++);
      const Tensor t = r == world.rank() ? mine.at(key).clone() : Tensor::empty(shape, dtype);
      world.broadcast(t, r);
      out[key] = t;
    }
  }
  return out;
}

void load_world_hook_state(const char* program, parallel::CommHook* hook, int rank,
                           optim::Optimizer::StateDict& dict, const std::vector<int64_t>& layout,
                           const char* layout_flags) {
  std::map<std::string, Tensor> saved = take_comm_entries(dict);
  if (hook == nullptr || saved.empty()) return;
  check_hook_kind(program, saved, *hook);
  TS_CHECK(saved.count("layout") != 0,
           "{}: the checkpoint's gradient compression state was saved by a run without --pp "
           "or --tp (gathered over dp, not per rank): resume with that run's --dp and --zero",
           program);
  const std::vector<int64_t> was = saved.at("layout").to_vector<int64_t>();
  TS_CHECK(was == layout,
           "{}: the checkpoint's gradient compression state was saved by a run of {} [{}]; this "
           "run has [{}]: resume with the same (each rank's error feedback is its own)",
           program, layout_flags, fmt::join(was, ", "), fmt::join(layout, ", "));
  const std::string prefix = fmt::format("r{}.", rank);
  std::map<std::string, Tensor> mine;
  for (const auto& [key, v] : saved) {
    if (key.starts_with(prefix)) mine[key.substr(prefix.size())] = v.contiguous().clone();
  }
  hook->load_state_dict(mine);
}

}  // namespace tessera::models
