#include "tensor/quant8.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tessera {
namespace {

Quant8Map build(Quant8Kind kind) {
  const bool is_signed = kind == Quant8Kind::signed_dynamic;
  std::vector<double> v;
  for (int e = 0; e <= 6; ++e) {
    const int f = (is_signed ? 6 : 7) - e;  // fraction bits left after the exponent
    const double scale = std::pow(10.0, -e), steps = std::ldexp(1.0, f);
    for (int j = 0; j < (1 << f); ++j) {
      const double x = scale * (0.1 + 0.9 * (j + 0.5) / steps);
      v.push_back(x);
      if (is_signed) v.push_back(-x);
    }
  }
  v.push_back(0.0);
  v.push_back(1.0);
  Quant8Map m;
  std::vector<float> f(v.begin(), v.end());  // each rounded to f32 once
  std::sort(f.begin(), f.end());
  std::copy(f.begin(), f.end(), m.values.begin());
  for (int k = 0; k < 255; ++k) {
    // Exact: both are f32 and a sum of two f32 of this range fits a double.
    const double mid = (static_cast<double>(m.values[k]) + m.values[k + 1]) / 2;
    m.mid64[k] = mid;
    float t = static_cast<float>(mid);
    if (static_cast<double>(t) < mid) t = std::nextafter(t, std::numeric_limits<float>::infinity());
    m.thresholds[k] = t;
  }
  m.thresholds[255] = std::numeric_limits<float>::infinity();
  m.mid64[255] = std::numeric_limits<double>::infinity();
  return m;
}

}  // namespace

uint8_t Quant8Map::zero_code() const { return code(0.0f); }

const Quant8Map& quant8_map(Quant8Kind kind) {
  static const Quant8Map maps[2] = {build(Quant8Kind::signed_dynamic),
                                    build(Quant8Kind::unsigned_dynamic)};
  return maps[static_cast<int>(kind)];
}

}  // namespace tessera
