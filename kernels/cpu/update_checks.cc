#include "kernels/cpu/update_checks.h"

#include <string>

#include "tensor/error.h"
#include "tensor/quant8.h"

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

void check_adamw8bit_operands(std::span<const std::span<const Tensor>> tuples, size_t count) {
  static constexpr const char* kNames[] = {"param",          "grad",
                                           "exp_avg",        "exp_avg_sq",
                                           "exp_avg_absmax", "exp_avg_sq_absmax",
                                           "master"};
  for (size_t j = 0; j < tuples.size(); ++j) {
    check_no_overlap("adamw8bit_", j, count, tuples[j],
                     {kNames[0], kNames[1], kNames[2], kNames[3], kNames[4], kNames[5], kNames[6]});
    for (size_t i = 0; i < tuples[j].size(); ++i) {
      const Tensor& x = tuples[j][i];
      if (i == 1) continue;  // grad: any layout
      TS_CHECK(!x.defined() || x.is_contiguous(),
               "adamw8bit_{}: {} {} must be contiguous (blocks are runs of {} consecutive "
               "elements)",
               count == 0 ? std::string() : fmt::format(" tuple {} of {}", j, count), kNames[i],
               shape_str(x.shape()), kQuant8Block);
    }
  }
}

void check_adamw8bit_segments_operands(std::span<const Tensor> in) {
  static constexpr const char* kNames[] = {
      "param", "grad", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
      "master", "segments", "new_absmax", "new_sq_absmax"};
  check_no_overlap("adamw8bit_segments_", 0, 0, in,
                   {kNames[0], kNames[1], kNames[2], kNames[3], kNames[4], kNames[5], kNames[6],
                    kNames[7], kNames[8], kNames[9]});
  for (size_t i = 0; i < in.size(); ++i) {
    TS_CHECK(i == 1 || !in[i].defined() || in[i].is_contiguous(),
             "adamw8bit_segments_: {} {} must be contiguous", kNames[i], shape_str(in[i].shape()));
  }
  const int64_t n = in[0].numel(), blocks = in[4].numel();
  const int64_t* seg = static_cast<const int64_t*>(in[7].raw_data());
  const int64_t count = in[7].numel() / 2;
  int64_t end = 0, block = -1;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t e = seg[2 * s], b = seg[2 * s + 1];
    TS_CHECK(e > end && e - end <= kQuant8Block,
             "adamw8bit_segments_: segment {} ends at element {} after the previous one's end "
             "{}: segments hold 1 to {} elements, in order",
             s, e, end, kQuant8Block);
    TS_CHECK(b > block && b < blocks,
             "adamw8bit_segments_: segment {} is of block {} (the previous one's {}, {} scales): "
             "blocks must increase and be below the scales' length",
             s, b, block, blocks);
    end = e;
    block = b;
  }
  TS_CHECK(end == n, "adamw8bit_segments_: the segments end at element {} but param has {}", end,
           n);
}

std::vector<std::span<const Tensor>> tuples_of(std::span<const Tensor> in, size_t width) {
  if (in.size() < 2 * width) return {in};
  std::vector<std::span<const Tensor>> out;
  for (size_t j = 0; j < in.size() / width; ++j) out.push_back(in.subspan(j * width, width));
  return out;
}

}  // namespace tessera::cpu
