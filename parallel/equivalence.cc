#include "parallel/equivalence.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <vector>

#include "tensor/error.h"

namespace tessera::parallel {

const char* phase_name(CheckPhase phase) {
  switch (phase) {
    case CheckPhase::forward:
      return "forward";
    case CheckPhase::backward:
      return "backward";
    case CheckPhase::update:
      return "update";
  }
  return "?";
}

std::string Mismatch::str() const {
  const std::string at = fmt::format("{}", fmt::join(index, ", "));
  return fmt::format("mismatch at step {}, {}: {}{}: max abs error {:.3g}, max rel error {:.3g} "
                     "(tolerance {:.3g}) at element [{}]; layout {}",
                     step, phase_name(phase), name, where.empty() ? "" : " (" + where + ")",
                     max_abs, max_rel, tolerance, at, layout);
}

EquivalenceChecker::EquivalenceChecker(std::string layout, double tolerance)
    : layout_(std::move(layout)), tolerance_(tolerance) {
  TS_CHECK(std::isfinite(tolerance) && tolerance > 0,
           "EquivalenceChecker: the tolerance must be a finite number > 0, got {}", tolerance);
}

bool EquivalenceChecker::compare(int64_t step, CheckPhase phase, const std::string& name,
                                 const Tensor& got, const Tensor& want,
                                 const std::function<std::string(int64_t)>& where) {
  if (mismatch_) return false;
  Mismatch m;
  m.step = step;
  m.phase = phase;
  m.name = name;
  m.layout = layout_;
  m.tolerance = tolerance_;
  if (!got.defined() || !want.defined() || got.shape() != want.shape()) {
    m.name += fmt::format(": shape {} where one device has {}",
                          got.defined() ? shape_str(got.shape()) : "undefined",
                          want.defined() ? shape_str(want.shape()) : "undefined");
    m.max_abs = m.max_rel = INFINITY;
    mismatch_ = m;
    return false;
  }
  const std::vector<double> a = got.to_vector<double>(), b = want.to_vector<double>();
  double scale = 0.0, worst = -1.0;
  int64_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(b[i]));
    // NaN anywhere is the worst error there is.
    const double e = std::isnan(a[i]) != std::isnan(b[i]) ? INFINITY : std::abs(a[i] - b[i]);
    if (e > worst || std::isnan(e)) {
      worst = std::isnan(e) ? INFINITY : e;
      at = static_cast<int64_t>(i);
    }
  }
  worst = std::max(worst, 0.0);
  const double rel = scale > 0 ? worst / scale : worst;
  if (rel <= tolerance_) {
    ++compared_;
    worst_ = std::max(worst_, rel);
    return true;
  }
  m.max_abs = worst;
  m.max_rel = rel;
  int64_t rest = at;
  m.index.assign(static_cast<size_t>(got.dim()), 0);
  for (int64_t d = got.dim() - 1; d >= 0; --d) {
    m.index[static_cast<size_t>(d)] = rest % got.size(d);
    rest /= got.size(d);
  }
  if (where) m.where = where(at);
  mismatch_ = m;
  return false;
}

}  // namespace tessera::parallel
