#include "optim/adafactor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tensor/grad_mode.h"
#include "tensor/ops.h"

namespace tessera::optim {

const char* adafactor_mode_name(AdafactorMode mode) {
  switch (mode) {
    case AdafactorMode::hf:
      return "hf";
    case AdafactorMode::torch:
      return "torch";
    case AdafactorMode::optax:
      return "optax";
  }
  return "?";
}

AdafactorMode parse_adafactor_mode(const std::string& name) {
  for (AdafactorMode m : {AdafactorMode::hf, AdafactorMode::torch, AdafactorMode::optax}) {
    if (name == adafactor_mode_name(m)) return m;
  }
  fail("Adafactor: mode must be hf, torch or optax, got '{}'", name);
}

Adafactor::Adafactor(std::vector<Tensor> params, AdafactorOptions options)
    : Adafactor(std::vector<ParamGroup>{ParamGroup{std::move(params), {}}}, options) {}

Adafactor::Adafactor(std::vector<ParamGroup> groups, AdafactorOptions options)
    : Optimizer("Adafactor", std::move(groups), options.lr, options.weight_decay),
      options_(checked(options)) {}

AdafactorOptions Adafactor::checked(AdafactorOptions o) {
  TS_CHECK(std::isfinite(o.lr) && o.lr >= 0, "Adafactor: invalid lr {} (must be >= 0)", o.lr);
  TS_CHECK(std::isfinite(o.eps1) && o.eps1 >= 0, "Adafactor: invalid eps1 {} (must be >= 0)",
           o.eps1);
  TS_CHECK(std::isfinite(o.eps2) && o.eps2 >= 0, "Adafactor: invalid eps2 {} (must be >= 0)",
           o.eps2);
  TS_CHECK(std::isfinite(o.clip_threshold) && o.clip_threshold > 0,
           "Adafactor: invalid clip_threshold {} (must be > 0)", o.clip_threshold);
  TS_CHECK(std::isfinite(o.decay_rate) && o.decay_rate > 0,
           "Adafactor: invalid decay_rate {} (must be > 0: beta2_t = 1 - t^-decay_rate)",
           o.decay_rate);
  TS_CHECK(o.beta1 >= 0 && o.beta1 < 1, "Adafactor: invalid beta1 {} (must be in [0, 1))",
           o.beta1);
  TS_CHECK(o.mode != AdafactorMode::torch || o.beta1 == 0,
           "Adafactor: mode torch has no first moment; beta1 must be 0, got {}", o.beta1);
  TS_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
           "Adafactor: invalid weight_decay {} (must be >= 0)", o.weight_decay);
  TS_CHECK(o.min_dim_size_to_factor >= 1,
           "Adafactor: invalid min_dim_size_to_factor {} (must be >= 1)",
           o.min_dim_size_to_factor);
  return o;
}

std::pair<int64_t, int64_t> Adafactor::factored_dims(const Shape& shape) const {
  const int64_t n = static_cast<int64_t>(shape.size());
  if (n < 2) return {-1, -1};
  if (options_.mode != AdafactorMode::optax) return {n - 2, n - 1};
  // optax: the two largest dims (a stable sort, as numpy's argsort: ties keep their order),
  // when the smaller of them is large enough.
  std::vector<int64_t> order(shape.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return shape[a] < shape[b]; });
  const int64_t rows = order[order.size() - 2], cols = order.back();
  if (shape[rows] < options_.min_dim_size_to_factor) return {-1, -1};
  return {rows, cols};
}

namespace {
// The columns a row shard holds: all of the whole's, or (cols_sum) its numel / rows.
int64_t shard_cols(const RowShard& rs, const Tensor& p) {
  if (rs.global.size() < 2) return 1;
  return rs.cols_sum ? p.numel() / std::max<int64_t>(rs.rows, 1) : rs.global[1];
}
Shape without(const Shape& s, int64_t dim) {
  Shape out = s;
  out.erase(out.begin() + dim);
  return out;
}
// m <- beta1 m + (1 - beta1) x (no debiasing, as hf and optax); the new m is the update.
Tensor decay_first_moment(const Tensor& m, const Tensor& x, double beta1) {
  m.copy_(m * beta1 + x * (1.0 - beta1));
  return m;
}
// The second-moment average: beta2_t v + (1 - beta2_t) x, or (torch) its interpolation
// form v + (1 - beta2_t)(x - v), equal in exact arithmetic but rounded as each reference does.
Tensor decayed(bool torch, const Tensor& v, const Tensor& x, double beta2t) {
  return torch ? v + (x - v) * (1.0 - beta2t) : v * beta2t + x * (1.0 - beta2t);
}
// g / sqrt(max(v, floor)) (torch floors the estimate at eps1^2).
Tensor scaled_by_floored_rsqrt(const Tensor& g, const Tensor& v, double floor) {
  return g * rsqrt(maximum(v, full({}, floor, v.dtype(), v.device())));
}
}  // namespace

Optimizer::RowShardState Adafactor::row_shard_state(const std::string& name,
                                                    const Shape& global, int64_t /*run*/,
                                                    int64_t /*run_first*/) const {
  const bool columns_first = factored_dims(global) == std::pair<int64_t, int64_t>{1, 0};
  if (name == "exp_avg_sq_row") return columns_first ? RowShardState::whole : RowShardState::rows;
  if (name == "exp_avg_sq_col") return columns_first ? RowShardState::rows : RowShardState::whole;
  return RowShardState::elements;
}

std::vector<Optimizer::StateSpec> Adafactor::state_specs(const Tensor& p) const {
  const DType dt = p.dtype() == DType::f64 ? DType::f64 : DType::f32;
  std::vector<StateSpec> specs;
  if (const RowShard* rs = row_shard(p)) {
    // This shard's rows of the statistic over the columns, its columns of the one over the
    // rows ("row" and "col" as factored_dims names them: swapped for optax's tall matrices).
    const auto [r, c] = factored_dims(rs->global);
    if (r >= 0) {
      const int64_t per_row = rs->rows, per_col = shard_cols(*rs, p);
      specs.push_back({"exp_avg_sq_row", {r == 0 ? per_row : per_col}, dt});
      specs.push_back({"exp_avg_sq_col", {r == 0 ? per_col : per_row}, dt});
    } else {
      specs.push_back({"exp_avg_sq", p.shape(), dt});
    }
    if (options_.beta1 > 0) specs.push_back({"exp_avg", p.shape(), dt});
    return specs;
  }
  const auto [r, c] = factored_dims(p.shape());
  if (r >= 0) {
    specs.push_back({"exp_avg_sq_row", without(p.shape(), c), dt});  // over the columns
    specs.push_back({"exp_avg_sq_col", without(p.shape(), r), dt});  // over the rows
  } else {
    specs.push_back({"exp_avg_sq", p.shape(), dt});
  }
  if (options_.beta1 > 0) specs.push_back({"exp_avg", p.shape(), dt});
  return specs;
}

std::map<std::string, double> Adafactor::hyperparameters() const {
  return {{"mode", static_cast<double>(options_.mode)},
          {"relative_step", options_.relative_step ? 1.0 : 0.0},
          {"scale_parameter", options_.scale_parameter ? 1.0 : 0.0},
          {"eps1", options_.eps1},
          {"eps2", options_.eps2},
          {"clip_threshold", options_.clip_threshold},
          {"decay_rate", options_.decay_rate},
          {"beta1", options_.beta1},
          {"min_dim_size_to_factor", static_cast<double>(options_.min_dim_size_to_factor)}};
}

void Adafactor::set_hyperparameters(const std::map<std::string, double>& v) {
  const auto flag = [&](const char* name) {
    const double x = v.at(name);
    TS_CHECK(x == 0.0 || x == 1.0, "Adafactor: hparam.{} must be 0 or 1, got {}", name, x);
    return x == 1.0;
  };
  const double mode = v.at("mode");
  TS_CHECK(mode == 0.0 || mode == 1.0 || mode == 2.0,
           "Adafactor: hparam.mode must be 0 (hf), 1 (torch) or 2 (optax), got {}", mode);
  TS_CHECK(static_cast<AdafactorMode>(mode) == options_.mode,
           "Adafactor: the state was saved in mode {}, this optimizer runs mode {} (their state "
           "differs)", adafactor_mode_name(static_cast<AdafactorMode>(mode)),
           adafactor_mode_name(options_.mode));
  AdafactorOptions o = options_;
  o.relative_step = flag("relative_step");
  o.scale_parameter = flag("scale_parameter");
  o.eps1 = v.at("eps1");
  o.eps2 = v.at("eps2");
  o.clip_threshold = v.at("clip_threshold");
  o.decay_rate = v.at("decay_rate");
  o.beta1 = v.at("beta1");
  o.min_dim_size_to_factor = static_cast<int64_t>(v.at("min_dim_size_to_factor"));
  options_ = checked(o);
}

void Adafactor::step() {
  NoGradGuard no_grad;
  for_each_bucket_with_grad(
      [&](const Tensor& p) {
        std::map<std::string, Tensor> s;
        for (const StateSpec& spec : state_specs(p)) {
          s[spec.name] = zeros(spec.shape, spec.dtype, p.device());
        }
        return s;
      },
      [&](const ParamGroup& group, std::span<const Pending> bucket) {
        // Not elementwise: each parameter on its own (the bucket only shares the group).
        // Everything that can refuse is checked before any parameter changes (the bucket is
        // retried one parameter at a time after an Error).
        step_size(group.lr, 1.0, 0.0);
        for (const Pending& item : bucket) {
          if (const RowShard* rs = row_shard(item.param)) check_row_shard(*rs, item.param);
        }
        for (const Pending& item : bucket) {
          if (const RowShard* rs = row_shard(item.param)) {
            update_rows(group, item, *rs);
          } else {
            update(group, item);
          }
        }
      });
}

void Adafactor::update(const ParamGroup& group, const Pending& item) {
  const AdafactorOptions& o = options_;
  const Tensor& param = item.param;
  std::map<std::string, Tensor>& st = item.state->tensors;
  const DType dt = param.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor g = cast(item.grad, dt), w = cast(param, dt);
  const double t = static_cast<double>(item.state->step + 1);
  const double numel = static_cast<double>(std::max<int64_t>(param.numel(), 1));
  const auto rms = [&](const Tensor& x) { return std::sqrt(sum(x * x).item<double>() / numel); };
  const double lr = group.lr, wd = group.weight_decay;

  // (The parameter's RMS only where the step size uses it: two passes saved otherwise.)
  const double alpha = step_size(lr, t, uses_param_rms() ? rms(w) : 0.0);
  const double beta2t = 1.0 - std::pow(t, -o.decay_rate);
  const bool torch = o.mode == AdafactorMode::torch;
  const auto decay = [&](const std::string& name, const Tensor& x) {
    Tensor& v = st.at(name);
    v.copy_(decayed(torch, v, x, beta2t));
    return v;
  };

  const auto [r, c] = factored_dims(param.shape());
  const int64_t n = static_cast<int64_t>(param.shape().size());
  if (r == n - 2 && c == n - 1 && fusable(param) && (!torch || numel_of(param.shape()) ==
                                                     param.size(-2) * param.size(-1))) {
    return update_fused(group, item, alpha, beta2t);
  }
  // The second-moment estimate and the preconditioned update.
  const Tensor u = torch ? g * g : g * g + o.eps1;
  Tensor update;
  if (r >= 0) {
    const Tensor row = decay("exp_avg_sq_row", mean(u, {c}));
    const Tensor col = decay("exp_avg_sq_col", mean(u, {r}));
    const int64_t r_in_row = r < c ? r : r - 1;  // the row dim in `row`'s shape
    const Tensor row_mean = mean(row, {r_in_row}, /*keepdim=*/true);
    if (torch) {
      const Tensor floor = full({}, o.eps1, dt, param.device());
      const Tensor v = unsqueeze(row, c) * unsqueeze(col, r) / unsqueeze(maximum(row_mean, floor), c);
      update = scaled_by_floored_rsqrt(g, v, o.eps1 * o.eps1);
    } else {
      update = g * unsqueeze(rsqrt(row / row_mean), c) * unsqueeze(rsqrt(col), r);
    }
  } else {
    const Tensor v = decay("exp_avg_sq", u);
    update = torch ? scaled_by_floored_rsqrt(g, v, o.eps1 * o.eps1)
                   : g * rsqrt(v);
  }
  const double denom = std::max(1.0, rms(update) / o.clip_threshold);
  param.copy_(next_param(w, update, alpha, denom, lr, wd, st));  // (rounded to its dtype)
  ++item.state->step;
}

bool Adafactor::uses_param_rms() const {
  return options_.mode == AdafactorMode::torch || options_.scale_parameter;
}

bool Adafactor::fusable(const Tensor& param) const {
  // The fused passes (adafactor_stats_, adafactor_norm_, adafactor_apply_) take f32 and f64
  // matrices in place, on the CPU and on CUDA; a 16-bit parameter is updated in f32 by ops and
  // rounded once.
  return options_.fused && (param.dtype() == DType::f32 || param.dtype() == DType::f64) &&
         param.is_contiguous();
}

std::pair<double, double> Adafactor::final_form(double alpha, double lr, double wd) const {
  switch (options_.mode) {
    case AdafactorMode::hf: return {wd > 0 ? wd * alpha : 0.0, 0};
    case AdafactorMode::torch: return {wd > 0 ? lr * wd : 0.0, 1};
    case AdafactorMode::optax: return {wd > 0 ? wd : 0.0, 2};
  }
  return {0.0, 0};
}

void Adafactor::update_fused(const ParamGroup& group, const Pending& item, double alpha,
                             double beta2t) {
  // A factored matrix (or batch of them) over its last two dims: the same steps as update()
  // in three passes over it (tensor/ops.h), the small vectors with ops.
  const AdafactorOptions& o = options_;
  const Tensor& param = item.param;
  std::map<std::string, Tensor>& st = item.state->tensors;
  const DType dt = param.dtype();
  const bool torch = o.mode == AdafactorMode::torch;
  const int64_t M = param.size(-2), N = param.size(-1), B = param.numel() / std::max<int64_t>(M * N, 1);
  const Tensor g = item.grad.contiguous().reshape({B, M, N});
  const Tensor sums = Tensor::empty({B, M + N}, dt, param.device());
  adafactor_stats_(g, sums, torch ? 0.0 : o.eps1);
  Tensor& row = st.at("exp_avg_sq_row");
  Tensor& col = st.at("exp_avg_sq_col");
  const Tensor row2 = row.reshape({B, M}), col2 = col.reshape({B, N});
  row2.copy_(decayed(torch, row2, sums.narrow(1, 0, M) / static_cast<double>(N), beta2t));
  col2.copy_(decayed(torch, col2, sums.narrow(1, M, N) / static_cast<double>(M), beta2t));
  const Tensor row_mean = mean(row2, {1}, /*keepdim=*/true);
  Tensor a, b;
  bool product = true;
  double divisor = 1.0, floor = 0.0;
  if (torch) {  // (one matrix: the divisor is a scalar)
    a = row2;
    b = col2;
    product = false;
    divisor = std::max(row_mean.item<double>(), o.eps1);
    floor = o.eps1 * o.eps1;
  } else {
    a = rsqrt(row2 / row_mean).contiguous();
    b = rsqrt(col2).contiguous();
  }
  Tensor squares = zeros({1}, DType::f64, param.device());
  adafactor_norm_(g, a, b, squares, product, divisor, floor);
  const double numel = static_cast<double>(std::max<int64_t>(param.numel(), 1));
  const double denom = std::max(1.0, std::sqrt(squares.item<double>() / numel) / o.clip_threshold);
  const auto [c, form] = final_form(alpha, group.lr, group.weight_decay);
  const auto m = st.find("exp_avg");
  adafactor_apply_(param.reshape({B, M, N}), g, a, b,
                   m == st.end() ? Tensor() : m->second.reshape({B, M, N}), product, divisor,
                   floor, alpha / denom, o.beta1, c, static_cast<int64_t>(form));
  ++item.state->step;
}

double Adafactor::step_size(double lr, double t, double rms_param) const {
  const AdafactorOptions& o = options_;
  const double scale = std::max(o.eps2, rms_param);
  switch (o.mode) {
    case AdafactorMode::hf: {
      TS_CHECK(!o.relative_step || lr == 0,
               "Adafactor (hf): relative_step sets the step size itself, but lr is {}; set "
               "relative_step = false to follow lr", lr);
      const double rel = o.relative_step ? std::min(1e-2, 1.0 / std::sqrt(t)) : lr;
      return o.scale_parameter ? scale * rel : rel;
    }
    case AdafactorMode::torch:
      TS_CHECK(lr > 0, "Adafactor (torch): lr must be > 0 (the largest step), got {}", lr);
      return scale * std::min(lr, 1.0 / std::sqrt(t));
    case AdafactorMode::optax:
      return o.scale_parameter ? lr * scale : lr;
  }
  return 0;
}

Tensor Adafactor::next_param(const Tensor& w, Tensor update, double alpha, double denom,
                             double lr, double wd, std::map<std::string, Tensor>& st) const {
  const AdafactorOptions& o = options_;
  switch (o.mode) {
    case AdafactorMode::hf:
      update = update * (alpha / denom);
      if (o.beta1 > 0) update = decay_first_moment(st.at("exp_avg"), update, o.beta1);
      return wd > 0 ? w - w * (wd * alpha) - update : w - update;
    case AdafactorMode::torch:
      return (wd > 0 ? w * (1.0 - lr * wd) : w) - update * (alpha / denom);
    case AdafactorMode::optax:
      update = update * (alpha / denom);
      if (o.beta1 > 0) update = decay_first_moment(st.at("exp_avg"), update, o.beta1);
      return wd > 0 ? w - (update + w * wd) : w - update;
  }
  return w;
}

void Adafactor::check_row_shard(const RowShard& rs, const Tensor& p) const {
  const auto [r, c] = factored_dims(rs.global);
  TS_CHECK(rs.rows >= 0 && rs.rows * shard_cols(rs, p) == p.numel() &&
               (!rs.cols_sum || rs.global.size() == 2),
           "Adafactor: a row shard of {} with {} rows{} cannot hold {} elements", shape_str(rs.global),
           rs.rows, rs.cols_sum ? " and some of the columns" : "", p.numel());
  TS_CHECK(rs.global.size() <= 2, "Adafactor: row shards cover 1-D and 2-D parameters, got {}",
           shape_str(rs.global));
  TS_CHECK(r < 0 || (r == 0 && c == 1) || (r == 1 && c == 0),
           "Adafactor ({}): on row shards a factored parameter must be 2-D; shape {} is "
           "factored over dims {} and {}", adafactor_mode_name(options_.mode),
           shape_str(rs.global), r, c);
}

void Adafactor::update_rows(const ParamGroup& group, const Pending& item, const RowShard& rs) {
  const AdafactorOptions& o = options_;
  const Tensor& param = item.param;
  std::map<std::string, Tensor>& st = item.state->tensors;
  const DType dt = param.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const bool torch = o.mode == AdafactorMode::torch;
  const bool factored = factored_dims(rs.global).first >= 0;
  // The whole is M x N; this shard its `rows` rows of `cols` of the columns (all, unless
  // cols_sum is given).
  const int64_t M = rs.global[0], N = rs.global.size() == 2 ? rs.global[1] : 1;
  const int64_t cols = shard_cols(rs, param);
  const double numel = static_cast<double>(numel_of(rs.global));
  const Shape local = factored ? Shape{rs.rows, cols} : param.shape();
  const Tensor g = cast(item.grad, dt).reshape(local), w = cast(param, dt).reshape(local);
  const double t = static_cast<double>(item.state->step + 1), lr = group.lr;
  const double beta2t = 1.0 - std::pow(t, -o.decay_rate);
  const auto blend = [&](const Tensor& v, const Tensor& x) { return decayed(torch, v, x, beta2t); };
  // A sum over every block of the parameter: over the other columns' holders, then the
  // other rows'.
  const auto sum_all = [&](const Tensor& x) {
    if (rs.cols_sum) rs.cols_sum(x);
    rs.sum(x);
  };
  // A factored f32/f64 shard takes the fused passes (tensor/ops.h): the sums of u along its
  // rows and down its columns in one pass, then the update's squares, then the write.
  const bool fused = factored && fusable(param);
  const Tensor g3 = fused ? item.grad.contiguous().reshape({1, rs.rows, cols}) : Tensor();
  Tensor sums;
  if (fused) {
    sums = Tensor::empty({1, rs.rows + cols}, dt, param.device());
    adafactor_stats_(g3, sums, torch ? 0.0 : o.eps1);
    sums = sums.reshape({rs.rows + cols});
  }
  const Tensor u = fused ? Tensor() : torch ? g * g : g * g + o.eps1;
  const auto row_sums = [&] { return fused ? sums.narrow(0, 0, rs.rows) : sum(u, {1}); };
  const auto col_sums = [&] { return fused ? sums.narrow(0, rs.rows, cols) : sum(u, {0}); };
  // The rows' means of u: this shard's columns' sums, plus the other columns' (cols_sum,
  // one all-reduce of [rows + 1] values with the parameter's squares).
  // (Zero where the step size does not use the parameter's RMS: two passes saved.)
  Tensor w_squares = uses_param_rms() ? sum(w * w).reshape({1})
                                      : zeros({1}, dt, param.device());
  Tensor row_means;
  if (factored && rs.cols_sum) {
    Tensor part = zeros({rs.rows + 1}, DType::f64, param.device());
    part.narrow(0, 0, rs.rows).copy_(row_sums());
    part.narrow(0, rs.rows, 1).copy_(w_squares);
    rs.cols_sum(part);
    row_means = cast(part.narrow(0, 0, rs.rows), dt) / static_cast<double>(N);
    w_squares = part.narrow(0, rs.rows, 1);
  } else if (factored) {
    row_means = fused ? row_sums() / static_cast<double>(N) : mean(u, {1});
  } else if (rs.cols_sum) {  // (a matrix kept whole: optax below its factoring size)
    w_squares = cast(w_squares, DType::f64);
    rs.cols_sum(w_squares);
  }
  // One sum over the other rows' holders: the parameter's squares, then (factored) the
  // columns' sums of u and (rows normalised) the new row statistics' sum.
  // optax factors a taller-than-wide matrix columns first: the statistic over its columns
  // (one per row, "exp_avg_sq_col" there) is then kept as is, and the one over its rows
  // ("exp_avg_sq_row", one per column) is the one divided by its mean, which is summed over
  // the other columns' holders.
  const bool columns_first = factored && factored_dims(rs.global).first == 1;
  const std::string per_row = columns_first ? "exp_avg_sq_col" : "exp_avg_sq_row";
  const std::string per_col = columns_first ? "exp_avg_sq_row" : "exp_avg_sq_col";
  Tensor stats = zeros({factored ? cols + 2 : 1}, DType::f64, param.device());
  stats.narrow(0, 0, 1).copy_(w_squares);
  Tensor rows_new;
  if (factored) {
    rows_new = blend(st.at(per_row), row_means);
    stats.narrow(0, 1, cols).copy_(col_sums());
    if (!columns_first) stats.narrow(0, cols + 1, 1).copy_(sum(rows_new).reshape({1}));
  }
  rs.sum(stats);
  const std::vector<double> s = stats.to_vector<double>();
  const double alpha = step_size(lr, t, std::sqrt(s[0] / numel));
  Tensor update;
  // The fused form: the update of element (i, j) from a row factor a_i and a column factor
  // b_j (tensor/ops.h), never materialised.
  Tensor fa, fb;
  bool product = true;
  double divisor = 1.0, floor = 0.0;
  if (factored) {
    st.at(per_row).copy_(rows_new);
    const Tensor& col = st.at(per_col);
    col.copy_(blend(col, cast(stats.narrow(0, 1, cols), dt) / static_cast<double>(M)));
    if (columns_first) {  // (optax: hf's formula, the column statistic normalised)
      Tensor col_sum = cast(sum(col), DType::f64).reshape({1});
      if (rs.cols_sum) rs.cols_sum(col_sum);
      const double col_mean = col_sum.item<double>() / static_cast<double>(N);
      fa = rsqrt(rows_new);
      fb = rsqrt(col / col_mean);
      if (!fused) update = g * unsqueeze(fb, 0) * unsqueeze(fa, 1);
    } else {
      const double row_mean = s[cols + 1] / static_cast<double>(M);
      if (torch) {
        fa = rows_new;
        fb = col;
        product = false;
        divisor = std::max(row_mean, o.eps1);
        floor = o.eps1 * o.eps1;
        if (!fused) {
          const Tensor v = unsqueeze(rows_new, 1) * unsqueeze(col, 0) / divisor;
          update = scaled_by_floored_rsqrt(g, v, floor);
        }
      } else {
        fa = rsqrt(rows_new / row_mean);
        fb = rsqrt(col);
        if (!fused) update = g * unsqueeze(fa, 1) * unsqueeze(fb, 0);
      }
    }
  } else {
    Tensor& v = st.at("exp_avg_sq");
    v.copy_(blend(v, u));
    update = torch ? scaled_by_floored_rsqrt(g, v, o.eps1 * o.eps1)
                   : g * rsqrt(v);
  }
  Tensor squares;
  if (fused) {
    fa = fa.contiguous().reshape({1, rs.rows});
    fb = fb.contiguous().reshape({1, cols});
    squares = zeros({1}, DType::f64, param.device());
    adafactor_norm_(g3, fa, fb, squares, product, divisor, floor);
  } else {
    squares = cast(sum(update * update).reshape({1}), DType::f64);
  }
  sum_all(squares);
  const double denom = std::max(1.0, std::sqrt(squares.item<double>() / numel) / o.clip_threshold);
  if (fused) {
    const auto [c, form] = final_form(alpha, lr, group.weight_decay);
    const auto m = st.find("exp_avg");  // (the shard's flat shape)
    adafactor_apply_(param.reshape({1, rs.rows, cols}), g3, fa, fb,
                     m == st.end() ? Tensor() : m->second.reshape({1, rs.rows, cols}), product,
                     divisor, floor, alpha / denom, o.beta1, c, static_cast<int64_t>(form));
    ++item.state->step;
    return;
  }
  // (The first moment has the shard's flat shape.)
  param.copy_(next_param(w.reshape(param.shape()), update.reshape(param.shape()), alpha, denom,
                         lr, group.weight_decay, st));
  ++item.state->step;
}

}  // namespace tessera::optim
