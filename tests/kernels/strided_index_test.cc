// kernels/cuda/strided_index.h on the CPU: the coalesced iteration space of the strided CUDA
// kernels gives every linear index the offsets a plain unravelling of the original shape
// gives (one dim, the 32-bit and the 64-bit arithmetic), and plan_copy picks each copy path only
// where that path's kernel reads and writes the right elements.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/strided_index.h"

namespace tessera::cuda_kernels {
namespace {

// The reference: i unravelled row-major over the original sizes, one operand's strides.
int64_t naive_offset(int64_t i, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  int64_t off = 0;
  for (int d = static_cast<int>(sizes.size()) - 1; d >= 0; --d) {
    off += (i % sizes[d]) * strides[d];
    i /= sizes[d];
  }
  return off;
}

DevTensor view(int dtype, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
               uintptr_t address) {
  DevTensor t;
  t.data = reinterpret_cast<void*>(address);  // never dereferenced: plan_copy reads alignment
  t.dtype = dtype;
  t.ndim = static_cast<int>(sizes.size());
  t.numel = 1;
  for (int d = 0; d < t.ndim; ++d) {
    t.sizes[d] = sizes[d];
    t.strides[d] = strides[d];
    t.numel *= sizes[d];
  }
  return t;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> s(sizes.size());
  int64_t st = 1;
  for (int d = static_cast<int>(sizes.size()) - 1; d >= 0; --d) {
    s[d] = st;
    st *= sizes[d];
  }
  return s;
}

Strided<2> coalesce2(const std::vector<int64_t>& sizes, const std::vector<int64_t>& a,
                     const std::vector<int64_t>& b) {
  const int64_t* st[2] = {a.data(), b.data()};
  return coalesce_dims<2>(static_cast<int>(sizes.size()), sizes.data(), st);
}

// A random operand layout over `sizes`: contiguous, permuted (a transpose), a slice of a
// larger tensor, or broadcast along some dims.
std::vector<int64_t> random_strides(const std::vector<int64_t>& sizes, std::mt19937& gen) {
  const int nd = static_cast<int>(sizes.size());
  std::vector<int64_t> st = contiguous_strides(sizes);
  switch (gen() % 4) {
    case 0: return st;
    case 1: {  // the dims stored in a shuffled order
      std::vector<int> order(nd);
      for (int d = 0; d < nd; ++d) order[d] = d;
      std::shuffle(order.begin(), order.end(), gen);
      int64_t s = 1;
      for (int j = nd - 1; j >= 0; --j) {
        st[order[j]] = s;
        s *= sizes[order[j]];
      }
      return st;
    }
    case 2: {  // a slice: every dim stored in a larger extent
      int64_t s = 1 + static_cast<int64_t>(gen() % 2);
      for (int d = nd - 1; d >= 0; --d) {
        st[d] = s;
        s *= sizes[d] + static_cast<int64_t>(gen() % 3);
      }
      return st;
    }
    default:  // broadcast along a random subset
      for (int d = 0; d < nd; ++d) {
        if (gen() % 2) st[d] = 0;
      }
      return st;
  }
}

TEST_CASE("coalesce_dims: the same offsets as the original shape, for 3,000 random layouts") {
  std::mt19937 gen(2026);
  int layouts = 0, merged = 0;
  int64_t indices = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int nd = 1 + static_cast<int>(gen() % 6);
    std::vector<int64_t> sizes(nd);
    for (int64_t& s : sizes) s = 1 + static_cast<int64_t>(gen() % 5);
    const std::vector<int64_t> a = random_strides(sizes, gen), b = random_strides(sizes, gen);
    const Strided<2> s = coalesce2(sizes, a, b);
    const int64_t* one[1] = {b.data()};  // one operand, as the reductions use it
    const Strided<1> s1 = coalesce_dims<1>(nd, sizes.data(), one);
    int64_t numel = 1, non_unit = 0;
    for (int64_t v : sizes) {
      numel *= v;
      non_unit += v != 1;
    }
    REQUIRE(s.small);
    REQUIRE(s.ndim <= non_unit);
    merged += s.ndim < non_unit;
    for (int64_t i = 0; i < numel; ++i) {
      int64_t o[2];
      s.offsets(i, o);
      REQUIRE(o[0] == naive_offset(i, sizes, a));
      REQUIRE(o[1] == naive_offset(i, sizes, b));
      int64_t o1[1];
      s1.offsets(i, o1);
      REQUIRE(o1[0] == o[1]);
      ++indices;
    }
    ++layouts;
  }
  CHECK(layouts == 3000);
  CHECK(merged > 0);  // the sweep does exercise merging (how often depends on the draws)
  MESSAGE(layouts << " layouts, " << merged << " with merged dims, " << indices << " indices");
}

TEST_CASE("coalesce_dims: what merges and what does not") {
  // Contiguous, with size-1 dims: one dim.
  {
    const std::vector<int64_t> sizes = {1, 4, 1, 5, 6};
    const Strided<2> s = coalesce2(sizes, contiguous_strides(sizes), contiguous_strides(sizes));
    CHECK(s.ndim == 1);
    CHECK(s.sizes[0] == 120);
    CHECK(s.strides[0][0] == 1);
    CHECK(s.strides[1][0] == 1);
  }
  // A transpose [4, 5] read with strides (1, 4): nothing merges.
  {
    const Strided<2> s = coalesce2({4, 5}, {5, 1}, {1, 4});
    CHECK(s.ndim == 2);
  }
  // A [2, 3, 4] output with a broadcast bias row (0, 0, 1): the outer two merge.
  {
    const Strided<2> s = coalesce2({2, 3, 4}, {12, 4, 1}, {0, 0, 1});
    REQUIRE(s.ndim == 2);
    CHECK(s.sizes[0] == 6);
    CHECK(s.sizes[1] == 4);
    CHECK(s.strides[1][0] == 0);
  }
  // Columns 0..2 of a [4, 8] matrix, as [4, 3] with strides (8, 1): rows stay apart.
  {
    const Strided<2> s = coalesce2({4, 3}, {3, 1}, {8, 1});
    CHECK(s.ndim == 2);
  }
  // A scalar operand (nullptr strides) never stops a merge.
  {
    const std::vector<int64_t> sizes = {3, 7}, st = contiguous_strides(sizes);
    const int64_t* strides[2] = {st.data(), nullptr};
    const Strided<2> s = coalesce_dims<2>(2, sizes.data(), strides);
    CHECK(s.ndim == 1);
    CHECK(s.strides[1][0] == 0);
  }
  // Every dim of size 1: no dims, offset 0.
  {
    const Strided<2> s = coalesce2({1, 1}, {1, 1}, {5, 9});
    CHECK(s.ndim == 0);
    int64_t o[2] = {-1, -1};
    s.offsets(0, o);
    CHECK(o[0] == 0);
    CHECK(o[1] == 0);
  }
}

TEST_CASE("coalesce_dims: 32-bit arithmetic up to 2^32 - 1 elements, 64-bit beyond") {
  // 65537 x 65535 = 2^32 - 1 elements: the last index still fits 32 bits.
  {
    const std::vector<int64_t> sizes = {65537, 65535};
    const std::vector<int64_t> a = contiguous_strides(sizes), b = {1, 65537};
    const Strided<2> s = coalesce2(sizes, a, b);
    CHECK(s.small);
    const int64_t numel = 65537LL * 65535LL;
    CHECK(numel == static_cast<int64_t>(UINT32_MAX));
    for (int64_t i : {int64_t{0}, int64_t{65534}, int64_t{65535}, numel / 2, numel - 65536, numel - 1}) {
      int64_t o[2];
      s.offsets(i, o);
      CHECK(o[0] == naive_offset(i, sizes, a));
      CHECK(o[1] == naive_offset(i, sizes, b));
    }
  }
  // 70000 x 70000 (4.9e9 elements): 64-bit arithmetic, right past 2^32.
  {
    const std::vector<int64_t> sizes = {70000, 70000};
    const std::vector<int64_t> a = contiguous_strides(sizes), b = {1, 70000};
    const Strided<2> s = coalesce2(sizes, a, b);
    CHECK_FALSE(s.small);
    const int64_t numel = 70000LL * 70000LL, two32 = int64_t{1} << 32;
    for (int64_t i : {int64_t{0}, two32 - 1, two32, two32 + 70001, numel - 1}) {
      int64_t o[2];
      s.offsets(i, o);
      CHECK(o[0] == naive_offset(i, sizes, a));
      CHECK(o[1] == naive_offset(i, sizes, b));
    }
  }
}

constexpr uintptr_t kBase = 0x7f0000100000;  // 4 KiB aligned

TEST_CASE("plan_copy: each path where its kernel is right, and only there") {
  const auto path = [](const DevTensor& d, const DevTensor& s) { return plan_copy(d, s); };
  // Same dtype, both contiguous: one memcpy.
  {
    const CopyPlan p = path(view(kF32, {8, 16}, {16, 1}, kBase), view(kF32, {8, 16}, {16, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::memcpy);
  }
  // A cast between contiguous tensors: 4 f32 (16 bytes) to 4 bf16 per access.
  {
    const CopyPlan p = path(view(kBF16, {8, 16}, {16, 1}, kBase), view(kF32, {8, 16}, {16, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::vector);
    CHECK(p.vec == 4);
    CHECK(p.space.ndim == 1);
  }
  // The same cast with the destination 2 bytes off: flat, element by element.
  {
    const CopyPlan p = path(view(kBF16, {8, 16}, {16, 1}, kBase + 2), view(kF32, {8, 16}, {16, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::flat);
  }
  // bf16 columns 0..63 of a [8, 128] matrix, packed: rows of 8-element vectors.
  {
    const CopyPlan p = path(view(kBF16, {8, 64}, {64, 1}, kBase), view(kBF16, {8, 64}, {128, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::vector);
    CHECK(p.vec == 8);
    CHECK(p.space.ndim == 2);
  }
  // ... of a [8, 100] matrix: rows start off the vector grid, so strided.
  {
    const CopyPlan p = path(view(kBF16, {8, 64}, {64, 1}, kBase), view(kBF16, {8, 64}, {100, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::strided);
  }
  // 60 columns: not a multiple of 8, strided.
  {
    const CopyPlan p = path(view(kBF16, {8, 60}, {60, 1}, kBase), view(kBF16, {8, 60}, {128, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::strided);
  }
  // A transpose: strided.
  {
    const CopyPlan p = path(view(kF32, {64, 32}, {32, 1}, kBase), view(kF32, {64, 32}, {1, 64}, kBase + 8192));
    CHECK(p.path == CopyPath::strided);
    CHECK(p.space.ndim == 2);
  }
  // A bias row broadcast to [B, T, C] (expand then contiguous): vectors along C.
  {
    const CopyPlan p = path(view(kF32, {2, 3, 128}, {384, 128, 1}, kBase), view(kF32, {2, 3, 128}, {0, 0, 1}, kBase + 8192));
    CHECK(p.path == CopyPath::vector);
    CHECK(p.vec == 4);
    CHECK(p.space.ndim == 2);
  }
  // f64 to f16 (2 per access, the f64 side's 16 bytes), and bool to f32 (4).
  {
    CHECK(path(view(kF16, {3, 6}, {6, 1}, kBase), view(kF64, {3, 6}, {8, 1}, kBase + 4096)).vec == 2);
    CHECK(path(view(kF32, {4, 8}, {8, 1}, kBase), view(kB8, {4, 8}, {16, 1}, kBase + 4096)).vec == 4);
  }
  // Into a non-contiguous destination (a column block of a larger matrix).
  {
    const CopyPlan p = path(view(kF32, {4, 8}, {32, 1}, kBase + 64), view(kF32, {4, 8}, {8, 1}, kBase + 4096));
    CHECK(p.path == CopyPath::vector);
  }
}

TEST_CASE("plan_copy: on 2,000 random layouts, every vector is aligned, in range and consecutive") {
  std::mt19937 gen(28);
  const int dtypes[] = {kF32, kF64, kF16, kBF16, kI32, kI64, kB8, kU8};
  int plans = 0, vectors = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int nd = 1 + static_cast<int>(gen() % 4);
    std::vector<int64_t> sizes(nd);
    for (int64_t& s : sizes) s = 1 + static_cast<int64_t>(gen() % 4) * (gen() % 2 ? 8 : 1);
    const int dd = dtypes[gen() % 8], sd = dtypes[gen() % 8];
    const std::vector<int64_t> a = random_strides(sizes, gen), b = random_strides(sizes, gen);
    const int dsize = dev_dtype_size(dd), ssize = dev_dtype_size(sd);
    // Addresses aligned to the element, and sometimes to 16 bytes.
    const uintptr_t da = kBase + dsize * (gen() % 2 ? 0 : gen() % 8);
    const uintptr_t sa = kBase + (uintptr_t{1} << 24) + ssize * (gen() % 2 ? 0 : gen() % 8);
    const DevTensor dst = view(dd, sizes, a, da), src = view(sd, sizes, b, sa);
    const CopyPlan p = plan_copy(dst, src);
    ++plans;
    if (p.path == CopyPath::memcpy || p.path == CopyPath::flat) {
      // Both contiguous, so element i is at offset i on both sides.
      for (int64_t i = 0; i < dst.numel; ++i) {
        REQUIRE(naive_offset(i, sizes, a) == i);
        REQUIRE(naive_offset(i, sizes, b) == i);
      }
      if (p.path == CopyPath::memcpy) REQUIRE(dd == sd);
      continue;
    }
    if (p.path != CopyPath::vector) continue;
    ++vectors;
    REQUIRE(p.vec == 16 / std::max(dsize, ssize));
    REQUIRE(dst.numel % p.vec == 0);
    for (int64_t v = 0; v < dst.numel / p.vec; ++v) {
      int64_t o[2];
      p.space.offsets(v * p.vec, o);
      REQUIRE((da + o[0] * dsize) % (dsize * p.vec) == 0);
      REQUIRE((sa + o[1] * ssize) % (ssize * p.vec) == 0);
      for (int j = 0; j < p.vec; ++j) {
        REQUIRE(naive_offset(v * p.vec + j, sizes, a) == o[0] + j);
        REQUIRE(naive_offset(v * p.vec + j, sizes, b) == o[1] + j);
      }
    }
  }
  CHECK(plans == 2000);
  CHECK(vectors > 0);
  MESSAGE(plans << " plans, " << vectors << " on the vector path");
}

}  // namespace
}  // namespace tessera::cuda_kernels
