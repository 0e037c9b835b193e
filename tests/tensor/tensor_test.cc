// Tensor core: dtypes and their conversions, storage sharing, views without copies,
// reshape/contiguous copying only when needed, broadcasting, host transfers.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "tensor/allocator.h"
#include "tensor/host_pinning.h"
#include "tensor/ops.h"
#include "tensor/storage.h"
#include "tests/testing.h"

using namespace tessera;

TEST_CASE("f16 conversion rounds to nearest even, keeps subnormals, saturates to inf") {
  // Exactly representable values round-trip.
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f /* min normal */,
                  5.960464477539063e-08f /* min subnormal */}) {
    CHECK(static_cast<float>(Half(v)) == v);
  }
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1.0).
  CHECK(Half(1.0f + std::ldexp(1.0f, -11)).bits == Half(1.0f).bits);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even): rounds up.
  CHECK(static_cast<float>(Half(1.0f + 3 * std::ldexp(1.0f, -11))) == 1.0f + std::ldexp(1.0f, -9));
  // Just above the tie rounds up.
  CHECK(static_cast<float>(Half(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20))) ==
        1.0f + std::ldexp(1.0f, -10));
  CHECK(std::isinf(static_cast<float>(Half(65520.0f))));   // rounds past the max
  CHECK(static_cast<float>(Half(65519.0f)) == 65504.0f);   // rounds down to the max
  CHECK(std::isnan(static_cast<float>(Half(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(static_cast<float>(Half(1e-8f)) == 0.0f);          // below half the min subnormal
  CHECK(static_cast<float>(Half(3e-8f)) == 5.960464477539063e-08f);  // rounds up to it
  CHECK(std::signbit(static_cast<float>(Half(-0.0f))));
}

TEST_CASE("bf16 conversion rounds to nearest even") {
  CHECK(static_cast<float>(BFloat16(1.0f)) == 1.0f);
  // bf16 keeps 7 mantissa bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1 (even).
  CHECK(static_cast<float>(BFloat16(1.0f + std::ldexp(1.0f, -8))) == 1.0f);
  // 1 + 3 * 2^-8 is a tie between 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> up.
  CHECK(static_cast<float>(BFloat16(1.0f + 3 * std::ldexp(1.0f, -8))) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(std::isnan(static_cast<float>(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(static_cast<float>(BFloat16(std::numeric_limits<float>::infinity()))));
  // Near the top of the range the spacing is 2^120: 3e38 / 2^120 = 225.7 rounds to 226.
  CHECK(static_cast<float>(BFloat16(3.0e38f)) == std::ldexp(226.0f, 120));
}

// The conversions against an exact reference built in double arithmetic, over every 16-bit
// pattern and over f32 values chosen where rounding is decided (each half's value, the
// midpoints between neighbours and one f32 ulp either side, the overflow threshold, f32
// subnormals, NaNs with payloads) plus a million random bit patterns: each scalar conversion
// (F16C instructions where the build has them), the software path (tensor/dtype.h) and
// each cast of a whole run (kernels/cpu/copy.cc's run helpers, 8 lanes at a time), the run
// started at an odd offset so that the 8-lane groups and the scalar tail both see values.
namespace {
uint32_t f32_bits(float f) { return std::bit_cast<uint32_t>(f); }

// Exact value of f16 bits h (NaN: the payload moved to f32's top mantissa bits).
uint32_t ref_widen_f16(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 31) return sign | 0x7f800000u | (mant << 13);
  const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, static_cast<int>(exp) - 25);
  return sign | f32_bits(static_cast<float>(mag));
}

// f rounded to nearest even on a grid with `bits` mantissa bits below the leading one, whose
// normal binades start at 2^min_exp (below: the subnormal spacing 2^(min_exp - bits)):
// returns the rounded magnitude, or inf past max_finite's half-spacing.
double ref_round(double a, int bits, int min_exp, double overflow_at) {
  if (a >= overflow_at) return INFINITY;
  const int e = std::max(static_cast<int>(std::floor(std::log2(a))), min_exp);
  const double spacing = std::ldexp(1.0, e - bits);
  return std::nearbyint(a / spacing) * spacing;  // ties to even in the default rounding mode
}

uint16_t ref_narrow_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  if (std::isnan(f)) return sign | 0x7e00u;
  const double a = std::fabs(static_cast<double>(f));
  if (a == 0) return sign;
  const double r = ref_round(a, 10, -14, 65520.0);
  if (std::isinf(r)) return sign | 0x7c00u;
  if (r == 0) return sign;
  const int e = static_cast<int>(std::floor(std::log2(r)));
  if (e < -14) return sign | static_cast<uint16_t>(std::ldexp(r, 24));  // subnormal
  return sign | static_cast<uint16_t>(((e + 15) << 10) | static_cast<uint32_t>(std::ldexp(r, 10 - e) - 1024));
}

uint16_t ref_narrow_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if (std::isnan(f)) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const double a = std::fabs(static_cast<double>(f));
  if (a == 0) return sign;
  const double r = ref_round(a, 7, -126, std::ldexp(1.0, 128) - std::ldexp(1.0, 119));
  if (std::isinf(r)) return sign | 0x7f80u;
  return sign | static_cast<uint16_t>(f32_bits(static_cast<float>(r)) >> 16);
}

// Casts values (as a run starting at offset 3) to dt and returns the result's bits.
template <typename Bits>
std::vector<Bits> cast_run(const Tensor& t, DType dt) {
  const Tensor out = t.narrow(0, 3, t.numel() - 3).cast(dt);
  std::vector<Bits> bits(static_cast<size_t>(out.numel()));
  std::memcpy(bits.data(), out.raw_data(), bits.size() * sizeof(Bits));
  return bits;
}
}  // namespace

TEST_CASE("f16/bf16 conversions, scalar and in runs, against an exact reference") {
  // Widening: every 16-bit pattern.
  std::vector<uint16_t> patterns(65536 + 3);
  for (uint32_t h = 0; h < 65536; ++h) patterns[h + 3] = static_cast<uint16_t>(h);
  int64_t widen_bad = 0;
  for (DType dt : {DType::f16, DType::bf16}) {
    const Tensor t = Tensor::empty({static_cast<int64_t>(patterns.size())}, dt);
    std::memcpy(t.raw_data(), patterns.data(), patterns.size() * sizeof(uint16_t));
    const std::vector<uint32_t> run = cast_run<uint32_t>(t, DType::f32);
    REQUIRE(run.size() == 65536);
    for (uint32_t h = 0; h < 65536; ++h) {
      const uint16_t b = static_cast<uint16_t>(h);
      const uint32_t want = dt == DType::f16 ? ref_widen_f16(b) : h << 16;
      const float scalar = dt == DType::f16 ? static_cast<float>(Half::from_bits(b))
                                            : static_cast<float>(BFloat16::from_bits(b));
      const float soft = dt == DType::f16 ? detail::half_bits_to_float_soft(b) : scalar;
      widen_bad += (f32_bits(scalar) != want) + (f32_bits(soft) != want) + (run[h] != want);
    }
  }
  CHECK(widen_bad == 0);

  // Narrowing: values where the rounding is decided, then random bit patterns.
  std::vector<float> values(3, 0.0f);
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float v = std::bit_cast<float>(ref_widen_f16(static_cast<uint16_t>(h)));
    const float next = std::bit_cast<float>(ref_widen_f16(static_cast<uint16_t>(h + 1)));
    const float mid = static_cast<float>((static_cast<double>(v) + next) / 2);  // exact in f32
    for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      values.push_back(x);
      values.push_back(-x);
    }
  }
  for (float x : {65504.0f, 65519.996f, 65520.0f, 1e30f, INFINITY, std::ldexp(1.0f, -149),
                  std::ldexp(1.0f, -126), std::ldexp(3.0f, -140), 3.3895314e38f, 3.4028235e38f}) {
    values.push_back(x);
    values.push_back(-x);
  }
  for (uint32_t payload : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0xffc12345u, 0x7fe00000u}) {
    values.push_back(std::bit_cast<float>(payload));
  }
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 1000000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    values.push_back(std::bit_cast<float>(static_cast<uint32_t>(state >> 32)));
  }
  const Tensor t = Tensor::from_vector<float>(values, {static_cast<int64_t>(values.size())});
  const std::vector<uint16_t> f16 = cast_run<uint16_t>(t, DType::f16);
  const std::vector<uint16_t> bf16 = cast_run<uint16_t>(t, DType::bf16);
  REQUIRE(f16.size() == values.size() - 3);
  int64_t narrow_bad = 0, first_bad = -1;
  for (size_t i = 3; i < values.size(); ++i) {
    const float v = values[i];
    const uint16_t want16 = ref_narrow_f16(v), wantb = ref_narrow_bf16(v);
    const int64_t bad = (Half(v).bits != want16) + (detail::float_to_half_bits_soft(v) != want16) +
                        (f16[i - 3] != want16) + (BFloat16(v).bits != wantb) + (bf16[i - 3] != wantb);
    if (bad != 0 && first_bad < 0) first_bad = static_cast<int64_t>(i);
    narrow_bad += bad;
  }
  CAPTURE(first_bad);
  CHECK(narrow_bad == 0);
}

TEST_CASE("every dtype round-trips through a tensor and casts") {
  const std::vector<double> values = {0, 1, -2, 3, 100, -7};
  for (DType dt : kAllDTypes) {
    if (dt == DType::b8 || dt == DType::u8) continue;  // both below
    Tensor t = cast(Tensor::from_vector<double>(values, {2, 3}), dt);
    CHECK(t.dtype() == dt);
    CHECK(t.nbytes() == 6 * dtype_size(dt));
    CHECK(t.to_vector<double>() == values);
  }
  Tensor b = cast(Tensor::from_vector<double>({0, 2, -1, 0}, {4}), DType::b8);
  CHECK(b.to_vector<bool>() == std::vector<bool>{false, true, true, false});
  CHECK(cast(b, DType::f32).to_vector<float>() == std::vector<float>{0, 1, 1, 0});
  // u8 holds 0..255; casts to it truncate, then wrap modulo 256 (as PyTorch's integer casts).
  Tensor u = cast(Tensor::from_vector<double>({0, 1, 255, 7.9, 256, -1}, {6}), DType::u8);
  CHECK(u.nbytes() == 6);
  CHECK(u.to_vector<uint8_t>() == std::vector<uint8_t>{0, 1, 255, 7, 0, 255});
  CHECK(cast(u, DType::f32).to_vector<float>() == std::vector<float>{0, 1, 255, 7, 0, 255});
  CHECK(testing::contains(testing::error_of([&] { (void)(u + u); }), "u8"));
  // Float to int truncates toward zero, as in C and PyTorch.
  CHECK(cast(Tensor::from_vector<float>({2.7f, -2.7f}, {2}), DType::i32).to_vector<int32_t>() ==
        std::vector<int32_t>{2, -2});
}

TEST_CASE("dtype names parse and print") {
  CHECK(dtype_from_name("bf16") == DType::bf16);
  CHECK(dtype_from_name("float32") == DType::f32);
  CHECK(fmt::format("{}", DType::b8) == "bool");
  CHECK(dtype_from_name("u8") == DType::u8);
  CHECK(dtype_from_name("uint8") == DType::u8);
  CHECK_THROWS_AS(dtype_from_name("f8"), Error);
  CHECK(Device::parse("cuda:3") == cuda(3));
  CHECK(Device::parse("cpu") == kCPU);
  CHECK_THROWS_AS(Device::parse("tpu"), Error);
  CHECK_THROWS_AS(Device::parse("cuda:x"), Error);
}

TEST_CASE("views share storage and never copy") {
  Tensor x = arange(0, 24).reshape({2, 3, 4});
  CHECK(x.is_contiguous());
  Tensor t = x.transpose(0, 2);  // [4, 3, 2]
  CHECK(t.shape() == Shape{4, 3, 2});
  CHECK(t.strides() == Strides{1, 4, 12});
  CHECK(t.storage() == x.storage());
  CHECK(!t.is_contiguous());
  CHECK(t.to_vector<float>()[1] == 12.0f);  // t[0][0][1] = x[1][0][0]

  Tensor s = x.slice(2, 1, 4, 2);  // columns 1 and 3
  CHECK(s.shape() == Shape{2, 3, 2});
  CHECK(s.offset() == 1);
  CHECK(s.storage() == x.storage());
  CHECK(s.to_vector<float>() == std::vector<float>{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23});
  CHECK(x.slice(1, -2, 100).shape() == Shape{2, 2, 4});  // Python-style clamping

  Tensor n = x.narrow(1, 1, 2);
  CHECK(n.shape() == Shape{2, 2, 4});
  CHECK(n.offset() == 4);

  Tensor e = Tensor::from_vector<float>({1, 2, 3}, {3, 1}).expand({2, 3, 4});
  CHECK(e.strides() == Strides{0, 1, 0});
  CHECK(e.to_vector<float>()[4] == 2.0f);

  Tensor u = x.unsqueeze(1);
  CHECK(u.shape() == Shape{2, 1, 3, 4});
  CHECK(u.squeeze().shape() == Shape{2, 3, 4});
  CHECK(x.unsqueeze(-1).shape() == Shape{2, 3, 4, 1});
  CHECK(x.select(1, 2).shape() == Shape{2, 4});
  CHECK(x.select(1, 2).to_vector<float>()[0] == 8.0f);
  CHECK(x.permute({2, 0, 1}).shape() == Shape{4, 2, 3});
}

TEST_CASE("reshape views when strides allow and copies otherwise") {
  Tensor x = arange(0, 12).reshape({3, 4});
  Tensor v = x.reshape({2, 6});
  CHECK(v.storage() == x.storage());
  CHECK(x.reshape({-1}).shape() == Shape{12});
  Tensor t = x.t();                // [4, 3], not viewable as [12] in order
  Tensor r = t.reshape({12});
  CHECK(r.storage() != x.storage());
  CHECK(r.to_vector<float>() == std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  CHECK_THROWS_AS(t.view({12}), Error);
  // Splitting a transposed dim is still a view.
  Tensor split = t.view({2, 2, 3});
  CHECK(split.storage() == x.storage());
  CHECK(t.contiguous().is_contiguous());
  CHECK(x.contiguous().is_same(x));
  CHECK(x.flatten().shape() == Shape{12});
  CHECK(arange(0, 24).reshape({2, 3, 4}).flatten(1).shape() == Shape{2, 12});
}

TEST_CASE("NumPy broadcasting") {
  CHECK(broadcast_shapes("t", {2, 1, 4}, {3, 1}) == Shape{2, 3, 4});
  CHECK(broadcast_shapes("t", {}, {5}) == Shape{5});
  CHECK(broadcast_shapes("t", {0, 1}, {1, 3}) == Shape{0, 3});
  Tensor a = Tensor::from_vector<float>({1, 2}, {2, 1});
  Tensor b = Tensor::from_vector<float>({10, 20, 30}, {3});
  CHECK((a + b).to_vector<float>() == std::vector<float>{11, 21, 31, 12, 22, 32});
  CHECK((2.0 * b - 1.0).to_vector<float>() == std::vector<float>{19, 39, 59});
  CHECK((b / 10.0).to_vector<float>() == std::vector<float>{1, 2, 3});
}

TEST_CASE("copy_ writes in place with broadcasting and casting") {
  Tensor dst = zeros({2, 3}, DType::f64);
  Tensor view = dst.slice(1, 1, 3);  // writes through to dst
  view.copy_(Tensor::from_vector<int32_t>({7, 8}, {2}));
  CHECK(dst.to_vector<double>() == std::vector<double>{0, 7, 8, 0, 7, 8});
  const uint64_t v0 = dst.storage()->version();
  dst.copy_(ones({3}, DType::f32));
  CHECK(dst.storage()->version() == v0 + 1);
  CHECK(dst.to_vector<double>() == std::vector<double>(6, 1.0));
}

TEST_CASE("clone and cast copy; item reads one element") {
  Tensor x = arange(0, 4);
  Tensor c = x.clone();
  CHECK(c.storage() != x.storage());
  CHECK(cast(x, DType::f32).is_same(x));  // no-op cast returns the tensor itself
  CHECK(x.sum().item<float>() == 6.0f);
  CHECK_THROWS_AS(x.item<float>(), Error);
  CHECK(full({2, 2}, 3.5, DType::bf16).to_vector<float>() == std::vector<float>(4, 3.5f));
  CHECK(arange(5, 0, -2, DType::i64).to_vector<int64_t>() == std::vector<int64_t>{5, 3, 1});
  CHECK(arange(0, 1, 0.25).numel() == 4);
  CHECK(zeros_like(x).to_vector<float>() == std::vector<float>(4, 0.0f));
}

TEST_CASE("zero-size and zero-dim tensors") {
  Tensor e = zeros({0, 3});
  CHECK(e.numel() == 0);
  CHECK(sum(e, {0}).to_vector<float>() == std::vector<float>{0, 0, 0});
  CHECK((e + 1.0).shape() == Shape{0, 3});
  Tensor s = full({}, 2.0);
  CHECK(s.dim() == 0);
  CHECK((s * s).item<float>() == 4.0f);
  CHECK(s.reshape({1, 1}).shape() == Shape{1, 1});
}

TEST_CASE("allocator and memory scopes count live bytes") {
  Allocator& a = allocator_for(kCPU);
  const int64_t before = a.stats().allocated_bytes;
  MemoryTracker tracker;
  {
    Tensor t;
    {
      MemoryScope scope(&tracker);
      t = Tensor::empty({1000}, DType::f64);
    }
    Tensor outside = Tensor::empty({10}, DType::f32);  // not charged to the tracker
    CHECK(tracker.current() == 8000);
    CHECK(a.stats().allocated_bytes - before == 8040);
  }
  CHECK(tracker.current() == 0);
  CHECK(tracker.peak() == 8000);
  CHECK(a.stats().allocated_bytes == before);
}

TEST_CASE("large CPU blocks are cached and reused; empty_cache returns them") {
  if (const char* env = std::getenv("TESSERA_CPU_CACHE_MB"); env != nullptr && std::atoll(env) == 0) {
    MESSAGE("skipped: TESSERA_CPU_CACHE_MB=0 disables the cache (sanitizer runs set it so "
            "freed blocks really are freed)");
    return;
  }
  Allocator& a = allocator_for(kCPU);
  a.empty_cache();
  const int64_t reserved0 = a.stats().reserved_bytes;
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({3 << 20}, DType::f32);  // 12 MiB: a cached size class
    first = t.raw_data();
    CHECK(reinterpret_cast<uintptr_t>(first) % (2 << 20) == 0);  // huge-page aligned
    CHECK(a.stats().reserved_bytes - reserved0 >= 12 << 20);
  }
  // Freed: no longer live, still reserved; the same class gets the same block back.
  CHECK(a.stats().reserved_bytes - reserved0 >= 12 << 20);
  {
    Tensor again = Tensor::empty({3 << 20}, DType::f32);
    CHECK(again.raw_data() == first);
    Tensor slightly_smaller = Tensor::empty({(3 << 20) - 100}, DType::f32);  // same class
    CHECK(slightly_smaller.raw_data() != first);
  }
  a.empty_cache();
  CHECK(a.stats().reserved_bytes == reserved0);
}

TEST_CASE("the host tier: outside the device's counters and budget, page-aligned, cached, "
          "pinned through the registered hook") {
  Allocator& device = allocator_for(kCPU);
  Allocator& host = host_tier_allocator();
  CHECK_FALSE(host.is_device());
  host.empty_cache();
  std::vector<std::pair<void*, int64_t>> pinned, unpinned;
  register_host_pinning({[&](void* p, int64_t n) { pinned.emplace_back(p, n); },
                         [&](void* p, int64_t n) { unpinned.emplace_back(p, n); }});
  const int64_t device_before = device.stats().allocated_bytes;
  const int64_t process_before = process_memory().current();
  const int64_t cap = device.limit();
  device.set_limit(device_before + 4096);  // the device has no room; the host tier does
  MemoryTracker tracker;
  void* first = nullptr;
  {
    MemoryScope scope(&tracker);
    HostTierScope tier;
    CHECK(HostTierScope::active());
    Tensor t = Tensor::empty({5000}, DType::f64);  // 40,000 bytes
    first = t.raw_data();
    CHECK(t.storage()->allocator() == &host);
    CHECK(reinterpret_cast<uintptr_t>(first) % 4096 == 0);
    CHECK(host.stats().allocated_bytes == 40000);
    CHECK(device.stats().allocated_bytes == device_before);
    CHECK(tracker.current() == 0);  // a rank's tracker counts its device
    CHECK(process_memory().current() == process_before);
    // Released and reallocated (the file tier's paging): the cached block comes back.
    t.storage()->release();
    t.storage()->reallocate();
    CHECK(t.raw_data() == first);
  }
  CHECK_FALSE(HostTierScope::active());
  device.set_limit(cap);
  CHECK(host.stats().allocated_bytes == 0);
  REQUIRE(pinned.size() == 1);
  CHECK(pinned[0] == std::make_pair(first, int64_t{40960}));  // whole pages
  CHECK(unpinned.empty());  // cached, still pinned
  host.empty_cache();
  REQUIRE(unpinned.size() == 1);
  CHECK(unpinned[0] == pinned[0]);
  register_host_pinning({});
  // A backend's asynchronous copy to the host tier, by device type (the CUDA backend's goes
  // on its communication stream; this one copies at once and counts its waits).
  const int kType = 7;  // no real device type: nothing else looks it up
  CHECK_FALSE(async_to_host(kType));
  int waits = 0;
  register_async_to_host(kType, [&](void* dst, const void* src, int64_t n, int, void*) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return std::function<void()>([&] { ++waits; });
  });
  const std::vector<float> from = {1.5f, -2.0f, 3.25f};
  std::vector<float> to(3, 0.0f);
  const AsyncToHost copy = async_to_host(kType);
  REQUIRE(copy);
  const std::function<void()> wait = copy(to.data(), from.data(), 12, 0, nullptr);
  REQUIRE(wait);
  wait();
  CHECK(waits == 1);
  CHECK(to == from);
  register_async_to_host(kType, {});
  CHECK_FALSE(async_to_host(kType));
}

TEST_CASE("a device without a linked backend (or without hardware) is a clear error") {
  // Without --config=cuda no CUDA allocator is registered; with it but no GPU, the backend
  // reports that no device is visible. Either way: tessera::Error, never a crash.
  CHECK_THROWS_AS(Tensor::empty({2}, DType::f32, cuda(7)), Error);
}
