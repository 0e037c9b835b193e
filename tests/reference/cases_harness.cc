// The records' harness: input drawing and layouts (on the sweep's device) for every
// runner; the op sweep's run over dtypes x layouts x cases, comparisons that name the op,
// dtype, layout, shapes and the worst element, and the per-op tally of passed and failed
// runs.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>

#include "tests/reference/cases.h"

namespace tessera::sweep {

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::contiguous:
      return "contiguous";
    case Layout::permuted:
      return "permuted";
    case Layout::strided:
      return "strided";
    case Layout::expanded:
      return "expanded";
  }
  return "?";
}

Arg arg(Shape shape, Domain domain, std::optional<Domain> int_domain) {
  Arg a;
  a.shape = std::move(shape);
  a.domain = std::move(domain);
  a.int_domain = std::move(int_domain);
  return a;
}

Arg index_arg(Shape shape, int64_t lo, int64_t hi, DType dt) {
  Arg a = arg(std::move(shape), ints(lo, hi));
  a.dtype = dt;
  return a;
}

Arg fixed_arg(Shape shape, std::vector<double> values, DType dt) {
  Arg a = arg(std::move(shape), fixed(std::move(values)));
  a.dtype = dt;
  return a;
}

Arg absent_arg() {
  Arg a;
  a.absent = true;
  return a;
}

// ---- the sweep's device and failure accounting ---------------------------------------------

namespace {

Device g_device = kCPU;

struct FailureLog {
  OpTally* tally = nullptr;  // the op being swept
  int64_t count = 0;         // failures reported so far (all ops)
  int64_t printed = 0;       // printed for the current op
  int64_t limit = -1;        // Coverage::print_limit_per_op of the current sweep
};
FailureLog g_failures;

}  // namespace

const std::vector<OpSweep>& all_sweeps() {
  static const std::vector<OpSweep> sweeps = [] {
    std::vector<OpSweep> out;
    for (auto* family : {&elementwise_sweeps, &nn_sweeps, &data_sweeps, &optim_sweeps}) {
      for (OpSweep& s : family()) out.push_back(std::move(s));
    }
    return out;
  }();
  return sweeps;
}

Device sweep_device() { return g_device; }
void set_sweep_device(Device device) { g_device = device; }

Tensor on_sweep_device(const Tensor& t) { return g_device.is_cpu() ? t : t.to(g_device); }

void report_failure(const std::string& message) {
  ++g_failures.count;
  if (g_failures.tally != nullptr && g_failures.tally->first_failure.empty()) {
    g_failures.tally->first_failure = message;
  }
  if (g_failures.limit < 0 || g_failures.printed < g_failures.limit) {
    ++g_failures.printed;
    FAIL_CHECK(message);
  }
}

// ---- memory access without kernels ----------------------------------------------------------

namespace {

// A CPU tensor with t's shape, strides and offset over a host copy of t's whole storage
// (t itself on the CPU): gaps and all, so read_storage sees what a kernel wrote there too.
Tensor host_view(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  const int64_t n = t.storage()->nbytes() / dtype_size(t.dtype());
  const Tensor whole = Tensor::from_storage(t.storage(), {n}, {1}, 0, t.dtype()).to(kCPU);
  return Tensor::from_storage(whole.storage(), t.shape(), t.strides(), t.offset(), t.dtype());
}

template <typename T>
T to_storage(double v) {
  if constexpr (std::is_same_v<T, bool>)
    return v != 0.0;
  else if constexpr (is_low_precision_v<T>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <typename T>
double from_storage(T v) {
  if constexpr (std::is_same_v<T, bool>)
    return v ? 1.0 : 0.0;
  else if constexpr (is_low_precision_v<T>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

double sentinel(DType dt) {
  if (is_floating(dt)) return std::numeric_limits<double>::quiet_NaN();
  if (dt == DType::b8) return 1.0;
  return 1234567.0;  // an out-of-range index if a kernel ever reads a gap
}

DType stats_of(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

std::string describe(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return fmt::format("{}{} strides {} offset {}", dtype_name(t.dtype()), shape_str(t.shape()),
                     shape_str(t.strides()), t.offset());
}

}  // namespace

Tensor make_tensor(const NdArray& a, DType dt) {
  Tensor t = Tensor::empty(a.shape, dt);
  visit_dtype(dt, [&]<typename T>() {
    T* p = static_cast<T*>(t.raw_data());
    for (int64_t i = 0; i < a.numel(); ++i) {
      const double v = a.data[i];
      if (!std::isnan(v) && ref::round_to(v, dt) != v) {
        throw std::logic_error(fmt::format("make_tensor: {} is not a {} value", v, dt));
      }
      p[i] = to_storage<T>(v);
    }
  });
  return t;
}

NdArray read_tensor(const Tensor& device_tensor) {
  const Tensor t = host_view(device_tensor);
  NdArray out = NdArray::zeros(t.shape());
  visit_dtype(t.dtype(), [&]<typename T>() {
    const T* base = static_cast<const T*>(t.raw_data());
    const Shape& shape = t.shape();
    const Strides& strides = t.strides();
    std::vector<int64_t> idx(shape.size(), 0);
    int64_t off = 0;  // sum of idx[d] * strides[d], kept up to date as idx advances
    for (int64_t i = 0; i < out.numel(); ++i) {
      out.data[i] = from_storage(base[off]);
      for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
        off += strides[d];
        if (++idx[d] < shape[d]) break;
        off -= idx[d] * strides[d];
        idx[d] = 0;
      }
    }
  });
  return out;
}

double read_storage(const Tensor& device_tensor, int64_t i) {
  const Tensor t = host_view(device_tensor);
  return visit_dtype(t.dtype(), [&]<typename T>() {
    return from_storage(static_cast<const T*>(t.storage()->data())[i]);
  });
}

void inplace_effects(const std::function<void(const Tensors&)>& update, size_t n_inputs,
                     std::vector<size_t> written_inputs, const char* op) {
  Tensors in;
  for (size_t i = 0; i < n_inputs; ++i) {
    in.push_back(build(NdArray::zeros({3, 4}, 0.5), DType::f32, Layout::strided, i).tensor);
  }
  std::vector<uint64_t> before;
  for (const Tensor& t : in) before.push_back(t.storage()->version());
  {
    NoGradGuard no_grad;
    update(in);
  }
  for (size_t i = 0; i < in.size(); ++i) {
    const bool is_written =
        std::find(written_inputs.begin(), written_inputs.end(), i) != written_inputs.end();
    CHECK_MESSAGE(in[i].storage()->version() == before[i] + (is_written ? 1 : 0), op,
                  ": input ", i, " version ", in[i].storage()->version(), " (was ", before[i],
                  ")");
    int64_t finite = 0;
    for (int64_t k = 0; k < in[i].storage()->nbytes() / 4; ++k) {
      finite += !std::isnan(read_storage(in[i], k));
    }
    CHECK_MESSAGE(finite == 12, op, ": input ", i, " has ", finite,
                  " non-NaN storage elements: the update wrote into its gaps");
  }
}

NdArray draw(const Arg& a, DType dt, uint64_t seed) {
  const Domain& d = (is_floating(dt) || !a.int_domain) ? a.domain : *a.int_domain;
  const int64_t n = ref::count(a.shape);
  Generator gen(seed);
  const std::vector<double> z = read_tensor(randn({n}, DType::f64, kCPU, &gen)).data;
  const std::vector<double> u = read_tensor(rand({n}, DType::f64, kCPU, &gen)).data;
  NdArray out = NdArray::zeros(a.shape);
  Domain::Kind kind = d.kind;
  if (dt == DType::b8 && kind != Domain::Kind::fixed) kind = Domain::Kind::boolean;
  for (int64_t i = 0; i < n; ++i) {
    double& v = out.data[i];
    switch (kind) {
      case Domain::Kind::normal:
        v = d.a + d.b * z[i];
        break;
      case Domain::Kind::uniform:
        v = d.a + (d.b - d.a) * u[i];
        break;
      case Domain::Kind::away_from_zero:
        v = std::copysign(d.a + (d.b - d.a) * u[i], z[i]);
        break;
      case Domain::Kind::integers:
        v = std::min(d.b, std::floor(d.a + (d.b - d.a + 1) * u[i]));
        break;
      case Domain::Kind::nonzero_integers: {
        std::vector<double> choices;
        for (double k = d.a; k <= d.b; ++k) {
          if (k != 0) choices.push_back(k);
        }
        v = choices[std::min<size_t>(choices.size() - 1,
                                     static_cast<size_t>(u[i] * choices.size()))];
        break;
      }
      case Domain::Kind::boolean:
        v = u[i] < 0.5 ? 1.0 : 0.0;
        break;
      case Domain::Kind::fixed:
        if (static_cast<int64_t>(d.values.size()) != n) {
          throw std::logic_error("draw: fixed values do not fill the shape");
        }
        v = d.values[i];
        break;
    }
  }
  return ref::round_to(out, dt);
}

Built build(const NdArray& values, DType dt, Layout layout, size_t arg_index, bool expandable) {
  const int64_t nd = values.ndim();
  switch (layout) {
    case Layout::contiguous:
      break;
    case Layout::permuted: {
      if (nd < 2) break;
      std::vector<int64_t> order(nd);  // storage dim i holds logical dim order[i]
      for (int64_t i = 0; i < nd; ++i) order[i] = nd - 1 - i;
      const Tensor base = on_sweep_device(make_tensor(ref::permute(values, order), dt));
      Strides strides(nd);
      for (int64_t i = 0; i < nd; ++i) strides[order[i]] = base.strides()[i];
      return {Tensor::from_storage(base.storage(), values.shape, strides, 0, dt), values, true};
    }
    case Layout::strided: {
      if (nd == 0) break;
      Shape big = values.shape;
      big.back() = 2 * big.back() + 1;
      if (nd >= 2) big[0] += 1;
      NdArray buf = NdArray::zeros(big, sentinel(dt));
      const int64_t rows = values.numel() == 0 ? 0 : values.numel() / values.shape.back();
      const int64_t inner = values.shape.back(), row_len = big.back();
      const int64_t skip = nd >= 2 ? ref::count(big) / big[0] : 0;  // the extra first slab
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < inner; ++j)
          buf.data[skip + r * row_len + 2 * j + 1] = values.data[r * inner + j];
      }
      const Tensor base = on_sweep_device(make_tensor(buf, dt));
      Strides strides = base.strides();
      strides.back() *= 2;
      const int64_t offset = (nd >= 2 ? base.strides()[0] : 0) + 1;
      return {Tensor::from_storage(base.storage(), values.shape, strides, offset, dt), values,
              true};
    }
    case Layout::expanded: {
      if (!expandable) break;
      for (int64_t k = 0; k < nd; ++k) {
        const int64_t d = (static_cast<int64_t>(arg_index) + k) % nd;
        if (values.shape[d] <= 1) continue;
        const NdArray one = ref::slice(values, d, 0, 1, 1);
        const Tensor base = on_sweep_device(make_tensor(one, dt));
        Strides strides = base.strides();
        strides[d] = 0;
        return {Tensor::from_storage(base.storage(), values.shape, strides, 0, dt),
                ref::broadcast_to(one, values.shape), true};
      }
      break;
    }
  }
  return {on_sweep_device(make_tensor(values, dt)), values, false};
}

// ---- comparisons ----------------------------------------------------------------------------

namespace {

// Checks |got - want| <= bound(i) elementwise (NaN must meet NaN, inf must equal); reports
// the element that exceeds its bound by the largest factor.
bool compare(const std::string& what, const NdArray& got, const NdArray& want,
             const std::function<double(int64_t)>& bound, const char* against) {
  if (got.shape != want.shape) {
    report_failure(fmt::format("{}: shape {}, expected {}", what, shape_str(got.shape),
                           shape_str(want.shape)));
    return false;
  }
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.data[i], w = want.data[i];
    double excess = 0;  // how far past the bound, relative to it
    if (std::isnan(w) || std::isnan(g)) {
      excess = std::isnan(w) && std::isnan(g) ? 0 : std::numeric_limits<double>::infinity();
    } else if (std::isinf(w) || std::isinf(g)) {
      excess = g == w ? 0 : std::numeric_limits<double>::infinity();
    } else {
      const double diff = std::fabs(g - w);
      const double b = std::isnan(bound(i)) ? 0.0 : bound(i);  // a NaN bound must not pass all
      if (diff > b) excess = b > 0 ? diff / b : std::numeric_limits<double>::infinity();
    }
    if (excess > 0) {
      ++bad;
      if (worst < 0 || excess > worst_excess) {
        worst = i;
        worst_excess = excess;
      }
    }
  }
  if (bad == 0) return true;
  const double g = got.data[worst], w = want.data[worst];
  report_failure(fmt::format(
      "{}: {} of {} elements off; worst at {}: got {:.10g}, want {:.10g} ({}), |diff| {:.3g} "
      "> bound {:.3g}",
      what, bad, got.numel(), shape_str(ref::unravel(worst, got.shape)), g, w, against,
      std::fabs(g - w), bound(worst)));
  return false;
}

// Rounding into dt's subnormal range adds up to half its smallest subnormal in absolute
// terms (the standard model fl(x) = x (1 + d) + e, |d| <= u, |e| <= that). f32 allows the
// smallest normal, 2^-126, instead: its vectorised exp flushes subnormal results to zero
// (flush-to-zero, as on GPUs), which no relative bound can describe.
double underflow(DType dt) {
  switch (dt) {
    case DType::f64:
      return std::ldexp(1.0, -1075);
    case DType::f32:
      return std::ldexp(1.0, -126);
    case DType::f16:
      return std::ldexp(1.0, -25);
    case DType::bf16:
      return std::ldexp(1.0, -134);
    default:
      return 0.0;
  }
}

NdArray saturate(const NdArray& a, DType dt) {
  return ref::map(a, [dt](double v) {
    const double r = ref::round_to(v, dt);
    return std::isinf(r) ? r : v;
  });
}


}  // namespace

namespace {
uint64_t seed_of(OpId op, size_t case_index, size_t arg_index) {
  return 1000003ull * (static_cast<uint64_t>(op) + 1) + 7919ull * case_index + 101ull * arg_index;
}

}  // namespace

DType arg_dtype(const Arg& a, DType dt) {
  if (a.dtype) return *a.dtype;
  return a.stats ? stats_of(dt) : dt;
}

namespace {
struct Prepared {
  Tensors tensors;
  Arrays seen;
  bool laid_out = false;
  std::string text;  // "in0 f16[3, 4] strides [...] offset 0, ..."
};

}  // namespace

Arrays draw_inputs(const OpSweep& s, const Case& c, size_t ci, DType dt) {
  Arrays vals;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    vals.push_back(a.absent ? NdArray::absent() : draw(a, arg_dtype(a, dt), seed_of(s.op, ci, i)));
  }
  if (c.prepare) {
    c.prepare(vals, dt);
    for (size_t i = 0; i < c.args.size(); ++i) {
      if (vals[i].defined) vals[i] = ref::round_to(vals[i], arg_dtype(c.args[i], dt));
    }
  }
  return vals;
}

namespace {
// Lays out `vals`; `compute_dt` replaces the case dtype (the f32 twin of a 16-bit run).
Prepared lay_out(const Case& c, const Arrays& vals, DType dt, DType compute_dt, Layout layout) {
  Prepared p;
  for (size_t i = 0; i < c.args.size(); ++i) {
    const Arg& a = c.args[i];
    if (a.absent) {
      p.tensors.emplace_back();
      p.seen.push_back(NdArray::absent());
      p.text += fmt::format("{}in{} undefined", i ? ", " : "", i);
      continue;
    }
    const DType adt = (!a.dtype && !a.stats) ? compute_dt : arg_dtype(a, dt);
    Built b = build(vals[i], adt, layout, i, a.expandable);
    p.laid_out |= b.laid_out;
    p.text += fmt::format("{}in{} {}", i ? ", " : "", i, describe(b.tensor));
    p.tensors.push_back(b.tensor);
    p.seen.push_back(std::move(b.seen));
  }
  return p;
}

}  // namespace

Tensors run_case(const OpSweep& s, const Case& c, const Tensors& in, DType dt) {
  if (c.run) return c.run(in, dt);
  Attrs a = c.attrs;
  const OpKind kind = op_info(s.op).kind;
  if (kind == OpKind::Factory) {
    a.dtype = dt;
    a.device = g_device;
  }
  if (s.op == OpId::to_device) a.device = g_device;  // a copy within the sweep's device
  if (kind == OpKind::View) return {call_view(s.op, in.at(0), a)};
  const std::vector<size_t> written = written_inputs(s, c);
  if (written.empty()) return call(s.op, in, a);
  if (s.op == OpId::copy_) {
    call_copy_(in.at(0), in.at(1));
  } else {
    call_inplace(s.op, in, a, written);
  }
  Tensors out;
  for (size_t i : written) out.push_back(in[i]);
  return out;
}

bool runs_in(const OpSweep& s, const Case& c, DType dt) {
  const auto has = [dt](const std::vector<DType>& v) {
    return std::find(v.begin(), v.end(), dt) != v.end();
  };
  return has(s.dtypes) && (c.dtypes.empty() || has(c.dtypes));
}

std::vector<size_t> written_inputs(const OpSweep& s, const Case& c) {
  std::vector<size_t> out;
  if (s.op != OpId::copy_ && op_info(s.op).family != OpFamily::InplaceUpdate) return out;
  for (size_t i = 0; i < c.args.size(); ++i) {
    if (!c.args[i].absent && !c.args[i].expandable) out.push_back(i);
  }
  return out;
}

namespace {
void run_one(const OpSweep& s, const Case& c, size_t ci, DType dt, Layout layout, Coverage& cov) {
  const Arrays vals = draw_inputs(s, c, ci, dt);
  const Prepared p = lay_out(c, vals, dt, dt, layout);
  if (layout != Layout::contiguous && !p.laid_out) return;  // nothing to lay out
  cov.combos.insert({static_cast<int>(s.op), static_cast<int>(dt), static_cast<int>(layout)});
  ++cov.runs;
  const std::string on = g_device.is_cpu() ? "" : fmt::format(" on {}", g_device);
  const std::string ctx = fmt::format("{}{} [{}, {}] case '{}' ({})", op_name(s.op), on,
                                      dtype_name(dt), layout_name(layout), c.label, p.text);
  Arrays want, mags;
  try {
    want = c.ref(p.seen, dt);
    if (c.mag) mags = c.mag(p.seen, dt);
  } catch (const std::exception& e) {
    report_failure(fmt::format("{}: the reference threw: {}", ctx, e.what()));
    return;
  }
  Tensors got;
  try {
    got = run_case(s, c, p.tensors, dt);
  } catch (const Error& e) {
    report_failure(fmt::format("{}: threw tessera::Error: {}", ctx, e.what()));
    return;
  } catch (const std::exception& e) {
    report_failure(fmt::format("{}: threw: {}", ctx, e.what()));
    return;
  }
  if (got.size() != want.size()) {
    report_failure(fmt::format("{}: {} outputs, expected {}", ctx, got.size(), want.size()));
    return;
  }
  std::optional<Tensors> twin;
  for (size_t k = 0; k < got.size(); ++k) {
    const std::string what = fmt::format("{}: output {}", ctx, k);
    if (!want[k].defined) {
      if (got[k].defined()) report_failure(fmt::format("{} should be undefined", what));
      continue;
    }
    if (!got[k].defined()) {
      report_failure(fmt::format("{} is undefined", what));
      continue;
    }
    ++cov.outputs_checked;
    const DType od = got[k].dtype();
    const DType want_dt = c.out_dtype ? c.out_dtype(dt, k) : dt;
    if (od != want_dt) {
      report_failure(
          fmt::format("{} has dtype {}, expected {}", what, dtype_name(od), dtype_name(want_dt)));
      continue;
    }
    if (c.views_input0 && got[k].storage() != p.tensors[0].storage()) {
      report_failure(fmt::format("{} is not a view of input 0 (it has its own storage)", what));
    }
    if (c.copies_input0 &&
        (got[k].storage() == p.tensors[0].storage() || !got[k].is_contiguous())) {
      report_failure(fmt::format("{} shares input 0's storage or is not contiguous", what));
    }
    const NdArray g = read_tensor(got[k]);
    const NdArray mag = k < mags.size() && mags[k].defined ? mags[k] : abs_of(want[k]);
    const std::string shaped =
        fmt::format("{} {}{}", what, dtype_name(od), shape_str(got[k].shape()));
    // A finite value beyond the output dtype's range is stored as infinity.
    const NdArray want_k = is_floating(od) ? saturate(want[k], od) : want[k];
    if (c.exact || !is_floating(od)) {
      compare(
          shaped, g, want_k, [](int64_t) { return 0.0; }, "reference, exact");
    } else if (od == DType::f32 || od == DType::f64) {
      const double rel = od == DType::f32 ? c.rel32 : c.rel64;
      compare(
          shaped, g, want_k, [&](int64_t i) { return rel * mag.data[i] + underflow(od); },
          "reference");
    } else {
      if (!twin) {
        const Prepared p32 = lay_out(c, vals, dt, DType::f32, layout);
        try {
          twin = run_case(s, c, p32.tensors, DType::f32);
        } catch (const std::exception& e) {
          report_failure(fmt::format("{}: the f32 twin threw: {}", ctx, e.what()));
          return;
        }
      }
      const NdArray y32 = read_tensor((*twin)[k]);
      compare(
          shaped + " (its f32 twin)", y32, saturate(want[k], DType::f32),
          [&](int64_t i) { return c.rel32 * mag.data[i] + underflow(DType::f32); }, "reference");
      const double u = ref::unit_roundoff(od);
      const double sub = c.rounds * underflow(od) + underflow(DType::f32);
      compare(
          shaped, g, saturate(y32, od),
          [&](int64_t i) {
            const double scale = c.rounds > 1 ? mag.data[i] : std::fabs(y32.data[i]);
            return c.rounds * u * scale + 2 * c.rel32 * mag.data[i] + sub;
          },
          "the f32 twin");
    }
  }
}

void check_rejected(const OpSweep& s, DType dt, Coverage& cov) {
  const Case& c = s.cases.front();
  const Arrays vals = draw_inputs(s, c, 0, dt);
  const Prepared p = lay_out(c, vals, dt, dt, Layout::contiguous);
  try {
    run_case(s, c, p.tensors, dt);
    report_failure(
        fmt::format("{} [{}] case '{}' ({}): accepted an unsupported dtype; expected "
                    "tessera::Error",
                    op_name(s.op), dtype_name(dt), c.label, p.text));
  } catch (const Error&) {
    ++cov.rejections_checked;
  } catch (const std::exception& e) {
    report_failure(fmt::format("{} [{}]: threw a non-tessera exception for an unsupported dtype: {}",
                               op_name(s.op), dtype_name(dt), e.what()));
  }
}

// Bounds that differ on a device other than the CPU, per op, with the reason. Everything
// not listed here keeps the CPU's bounds: they are error bounds of the evaluation (u times
// the magnitude of the terms), which hold for any summation order, tree or atomic, and allow
// flushing subnormal f32 results to zero (underflow() above). TF32 is off by default
// (kernels/cuda/runtime.h allow_tf32), so matmul and conv2d keep their f32 bounds; 16-bit
// index_add / scatter_add already allow one rounding per accumulated term, in any order.
void device_bounds(OpId op, Case& c) {
  switch (op) {
    case OpId::randn:
      // The CPU evaluates Box-Muller in f64 with glibc's log/cos and rounds once (within
      // u = 2^-24 of the exact normal). The device's f64 log/sincos (libdevice) may differ
      // from glibc by a few f64 ulps, and a kernel may evaluate the f32 draw with f32
      // intrinsics: allow a few f32 ulps, 2^-22 relative (the "within a few ulps");
      // f64 keeps rel64 = 1e-12 (~4500 ulps of 2^-53); f16/bf16 compare with their f32 twin.
      if (!c.exact) c.rel32 = 0x1p-22;
      break;
    default:
      break;
  }
}

}  // namespace

void run_sweep(const OpSweep& s, Coverage& cov) {
  OpTally& tally = cov.per_op[s.op];
  g_failures.tally = &tally;
  g_failures.printed = 0;
  g_failures.limit = cov.print_limit_per_op;
  // Counts one run as passed or failed by whether it reported a failure.
  auto account = [&](int64_t failures_before) {
    if (g_failures.count > failures_before) {
      ++tally.failed;
    } else {
      ++tally.passed;
    }
  };
  for (size_t ci = 0; ci < s.cases.size(); ++ci) {
    Case c = s.cases[ci];
    if (!g_device.is_cpu()) device_bounds(s.op, c);
    for (DType dt : s.dtypes) {
      if (!runs_in(s, c, dt)) continue;
      for (Layout layout : c.layouts) {
        const int64_t failures = g_failures.count, runs = cov.runs;
        try {
          run_one(s, c, ci, dt, layout, cov);
        } catch (const std::exception& e) {
          report_failure(fmt::format("{} [{}, {}] case '{}': harness error: {}", op_name(s.op),
                                     dtype_name(dt), layout_name(layout), c.label, e.what()));
        }
        if (cov.runs > runs || g_failures.count > failures) account(failures);
      }
    }
  }
  if (!s.cases.empty()) {
    for (DType dt : s.rejected) {
      const int64_t failures = g_failures.count;
      try {
        check_rejected(s, dt, cov);
      } catch (const std::exception& e) {
        report_failure(fmt::format("{} [{}]: harness error checking the rejection: {}",
                                   op_name(s.op), dtype_name(dt), e.what()));
      }
      account(failures);
    }
  }
  if (s.extra) {
    // The extra checks build their tensors on the CPU, except through build() (on the
    // sweep's device); an exception must not end the whole sweep.
    const int64_t failures = g_failures.count;
    try {
      s.extra();
    } catch (const std::exception& e) {
      report_failure(fmt::format("{}: extra checks threw: {}", op_name(s.op), e.what()));
    }
    account(failures);
  }
  g_failures.tally = nullptr;
  g_failures.limit = -1;
}

bool expect_close(const std::string& what, const Tensor& got, const NdArray& want, double rel,
                  double abs, const NdArray* mag) {
  if (!got.defined()) {
    report_failure(fmt::format("{}: undefined result", what));
    return false;
  }
  const NdArray m = mag ? *mag : abs_of(want);
  return compare(
      fmt::format("{} {}{}", what, dtype_name(got.dtype()), shape_str(got.shape())),
      read_tensor(got), want, [&](int64_t i) { return rel * m.data[i] + abs; }, "reference");
}

bool expect_same_bits(const std::string& what, const Tensor& got, const Tensor& want) {
  if (!got.defined() || !want.defined() || got.shape() != want.shape() || got.dtype() != want.dtype()) {
    report_failure(fmt::format("{}: got {} {}, want {} {}", what,
                               got.defined() ? dtype_name(got.dtype()) : "undefined", shape_str(got.shape()),
                               want.defined() ? dtype_name(want.dtype()) : "undefined", shape_str(want.shape())));
    return false;
  }
  const Tensor g = got.to(kCPU).contiguous(), w = want.to(kCPU).contiguous();
  const size_t elem = static_cast<size_t>(g.nbytes() / std::max<int64_t>(g.numel(), 1));
  const auto* gb = static_cast<const unsigned char*>(g.raw_data());
  const auto* wb = static_cast<const unsigned char*>(w.raw_data());
  for (int64_t i = 0; i < g.numel(); ++i) {
    if (std::memcmp(gb + i * elem, wb + i * elem, elem) == 0) continue;
    const NdArray gv = read_tensor(g), wv = read_tensor(w);
    report_failure(fmt::format("{}: element {} is {} where the other computation gives {}", what, i,
                               gv.data[static_cast<size_t>(i)], wv.data[static_cast<size_t>(i)]));
    return false;
  }
  return true;
}

void expect_error(const std::string& what, const std::function<void()>& f) {
  try {
    f();
    report_failure(fmt::format("{}: expected tessera::Error, nothing was thrown", what));
  } catch (const Error&) {
  } catch (const std::exception& e) {
    report_failure(
        fmt::format("{}: expected tessera::Error, got another exception: {}", what, e.what()));
  }
}

NdArray abs_of(const NdArray& a) {
  return ref::map(a, [](double v) { return std::fabs(v); });
}

Case unary(std::string label, Shape shape, Domain domain, std::function<double(double)> f,
           std::optional<Domain> int_domain) {
  Case c;
  c.label = std::move(label);
  c.args = {arg(std::move(shape), std::move(domain), std::move(int_domain))};
  c.ref = [f](const Arrays& in, DType) { return Arrays{ref::map(in[0], f)}; };
  return c;
}

}  // namespace tessera::sweep
