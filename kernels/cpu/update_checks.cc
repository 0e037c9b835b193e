#include "kernels/cpu/update_checks.h"

#include <string>

#include "tensor/error.h"

namespace tessera::cpu {

std::pair<int64_t, int64_t> byte_extent(const Tensor& t) {
  const int64_t size = dtype_size(t.dtype());
  int64_t lo = t.offset() * size, hi = lo + size;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.shape()[d] - 1) * t.strides()[d] * size;
    if (reach < 0) lo += reach;
    else hi += reach;
  }
  return {lo, hi};
}

void check_no_overlap(std::string_view op, size_t tuple, size_t tuples,
                      std::span<const Tensor> in, std::initializer_list<const char*> names) {
  std::vector<const char*> name(names);
  for (size_t i = 0; i < in.size(); ++i) {
    for (size_t j = i + 1; j < in.size(); ++j) {
      const Tensor& a = in[i];
      const Tensor& b = in[j];
      if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) continue;
      if (a.storage() != b.storage()) continue;
      const auto [alo, ahi] = byte_extent(a);
      const auto [blo, bhi] = byte_extent(b);
      if (alo < bhi && blo < ahi) {
        const std::string where =
            tuples == 0 ? std::string(op) : fmt::format("{} tuple {} of {}", op, tuple, tuples);
        fail("{}: {} {} and {} {} overlap in memory; each needs its own buffer", where, name[i],
             shape_str(a.shape()), name[j], shape_str(b.shape()));
      }
    }
  }
}

std::vector<std::span<const Tensor>> tuples_of(std::span<const Tensor> in, size_t width) {
  if (in.size() < 2 * width) return {in};
  std::vector<std::span<const Tensor>> out;
  for (size_t j = 0; j < in.size() / width; ++j) out.push_back(in.subspan(j * width, width));
  return out;
}

}  // namespace tessera::cpu
