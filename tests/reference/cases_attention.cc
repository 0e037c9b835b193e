// Records (cases.h): attention and attention_backward, the CPU kernel's in-place reads of
// strided heads, and attention_qkv (the packed form) with its backward.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tensor/op_attrs.h"
#include "tests/reference/cases.h"

namespace tessera::sweep {
namespace {

// ---- attention -------------------------------------------------------------------------------

using ref::AttentionRef;

struct Attn {
  const char* label;
  Shape shape;
  bool causal;
  double scale;
};
const Attn kAttention[] = {
    {"[2, 3, 5, 4] causal", {2, 3, 5, 4}, true, 0.0},
    {"[2, 3, 5, 4] not causal", {2, 3, 5, 4}, false, 0.0},
    {"[1, 2, 9, 8] causal, scale 0.5", {1, 2, 9, 8}, true, 0.5},
    {"[3, 1, 6, 3] not causal, scale -0.3", {3, 1, 6, 3}, false, -0.3},
    {"[1, 1, 1, 5] one query", {1, 1, 1, 5}, true, 0.0},
    // As tensor-parallel GPT runs it: causal, 4 heads (whole heads per rank on 2 and 4).
    {"[1, 4, 4, 3] causal, 4 heads", {1, 4, 4, 3}, true, 0.0},
    // Longer than the CPU kernel's block of 64 query rows: three blocks, the last partial.
    {"[1, 2, 130, 8] causal, 3 row blocks", {1, 2, 130, 8}, true, 0.0},
    {"[2, 1, 70, 5] not causal, 2 row blocks", {2, 1, 70, 5}, false, 0.0},
};

OpSweep attention_sweep() {
  OpSweep s{OpId::attention, kFloats, kNonFloat, {}, {}};
  for (const Attn& at : kAttention) {
    Case c;
    c.label = at.label;
    c.args = {arg(at.shape), arg(at.shape), arg(at.shape)};
    c.attrs.causal = at.causal;
    c.attrs.scale = at.scale;
    const AttentionRef r(at.shape, at.scale, at.causal);
    c.ref = [r](const Arrays& in, DType) { return r.forward(in, false); };
    c.mag = [r](const Arrays& in, DType) { return r.forward(in, true); };
    c.out_dtype = [](DType dt, size_t k) { return k == 0 || dt == DType::f64 ? dt : DType::f32; };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("attention k [1, 1, 4, 8] for q [1, 1, 3, 8]", [] {
      attention(zeros({1, 1, 3, 8}), zeros({1, 1, 4, 8}), zeros({1, 1, 3, 8}));
    });
    expect_error("attention 3-D q", [] {
      attention(zeros({1, 3, 8}), zeros({1, 3, 8}), zeros({1, 3, 8}));
    });
    expect_error("attention f64 v with f32 q, k", [] {
      attention(zeros({1, 1, 3, 8}), zeros({1, 1, 3, 8}), zeros({1, 1, 3, 8}, DType::f64));
    });
    // The first query of a causal attention sees only the first key: out_0 = v_0.
    const NdArray q = NdArray::of({1, 1, 2, 2}, {1, 2, 3, 4});
    const NdArray v = NdArray::of({1, 1, 2, 2}, {5, -6, 7, 8});
    const Tensor out = attention(make_tensor(q, DType::f64), make_tensor(q, DType::f64),
                                 make_tensor(v, DType::f64), true);
    expect_close("attention causal row 0", out.slice(2, 0, 1), NdArray::of({1, 1, 1, 2}, {5, -6}), 0);
    // On the CPU's f32 path a causal first query's dq is exactly 0: its one score has P = 1,
    // out_0 = v_0, and D_0 = dO_0 . out_0 is summed in the GEMM's order, so it equals the
    // GEMM's dP_00 = dO_0 . v_0 and dS_00 = 0 (attention.cc). D = 40 spans 40 terms.
    {
      constexpr int64_t B = 2, H = 3, T = 70, D = 40;
      const Tensor q = randn({B, H, T, D}), k = randn({B, H, T, D}), v = randn({B, H, T, D});
      const std::vector<Tensor> fwd = call(OpId::attention, {q, k, v}, op_attrs::attention(true, 0.0));
      const std::vector<Tensor> g =
          attention_backward(randn({B, H, T, D}), q, k, v, fwd[0], fwd[1], true, 0.0);
      const std::vector<float> dq0 = g[0].slice(2, 0, 1).contiguous().to_vector<float>();
      CHECK(dq0.size() == static_cast<size_t>(B * H * D));
      CHECK(std::all_of(dq0.begin(), dq0.end(), [](float x) { return x == 0.0f; }));
      const std::vector<float> dq1 = g[0].slice(2, 1, 2).contiguous().to_vector<float>();
      CHECK(std::any_of(dq1.begin(), dq1.end(), [](float x) { return x != 0.0f; }));
      // The same for every query when each row's softmax is exactly one-hot: q_i = 1000 e_0
      // and k_j[0] = j make the scores 158 apart (scale 1/sqrt(40)), so the earlier keys'
      // P underflow to exact zeros, out_i = v_i and dq_i = 0 in every row of both blocks
      // (each of the eight interleaved chains of D_i, and the rows past them).
      Tensor q1 = zeros({B, H, T, D}), k1 = randn({B, H, T, D});
      q1.slice(3, 0, 1).copy_(full({B, H, T, 1}, 1000.0));
      k1.slice(3, 0, 1).copy_(arange(0, T).view({1, 1, T, 1}).expand({B, H, T, 1}));
      const std::vector<Tensor> fwd1 = call(OpId::attention, {q1, k1, v}, op_attrs::attention(true, 0.0));
      const std::vector<Tensor> g1 =
          attention_backward(randn({B, H, T, D}), q1, k1, v, fwd1[0], fwd1[1], true, 0.0);
      const std::vector<float> dq = g1[0].contiguous().to_vector<float>();
      CHECK(dq.size() == static_cast<size_t>(B * H * T * D));
      CHECK(std::all_of(dq.begin(), dq.end(), [](float x) { return x == 0.0f; }));
      const std::vector<float> dv = g1[2].contiguous().to_vector<float>();
      CHECK(std::any_of(dv.begin(), dv.end(), [](float x) { return x != 0.0f; }));
    }
    // GPT's heads: q, k and v as [B, H, T, D] views of one [B, T, 3, H, D] product, the last
    // dim contiguous and the others strided, k and v at offsets. The CPU kernel reads such
    // views in place; forward and backward give the contiguous copies' bits, for T across
    // two row blocks of 64.
    for (const bool causal : {true, false}) {
      constexpr int64_t B = 2, T = 70, H = 3, D = 5;
      const Tensor qkv = randn({B, T, 3, H, D}).to(sweep_device());
      const Tensor dout = randn({B, H, T, D}).to(sweep_device());
      const auto head = [&](int64_t i) {
        return transpose(view(slice(qkv, 2, i, i + 1), {B, T, H, D}), 1, 2);
      };
      const auto bits = [](const Tensor& t) {  // raw f32 bytes: -0 and +0 differ
        const std::vector<float> v = t.to(kCPU).contiguous().to_vector<float>();
        std::vector<uint32_t> out(v.size());
        std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
        return out;
      };
      const std::vector<Tensor> views{head(0), head(1), head(2)};
      const std::vector<Tensor> copies{views[0].contiguous(), views[1].contiguous(),
                                       views[2].contiguous()};
      CHECK(!views[0].is_contiguous());
      const std::vector<Tensor> a = call(OpId::attention, views, op_attrs::attention(causal, 0.0));
      const std::vector<Tensor> b = call(OpId::attention, copies, op_attrs::attention(causal, 0.0));
      CHECK_MESSAGE(bits(a[0]) == bits(b[0]), "attention of strided heads (causal ", causal, ")");
      CHECK_MESSAGE(bits(a[1]) == bits(b[1]), "attention lse of strided heads (causal ", causal,
                    ")");
      const Tensor grad_view = transpose(transpose(dout, 1, 2).contiguous(), 1, 2);  // strided too
      const Tensor out_view = transpose(transpose(a[0], 1, 2).contiguous(), 1, 2);  // strided
      const std::vector<Tensor> ga = attention_backward(grad_view, views[0], views[1], views[2],
                                                        out_view, a[1], causal, 0.0);
      const std::vector<Tensor> gb = attention_backward(dout, copies[0], copies[1], copies[2], b[0],
                                                        b[1], causal, 0.0);
      for (size_t i = 0; i < 3; ++i) {
        CHECK_MESSAGE(bits(ga[i]) == bits(gb[i]), "attention_backward of strided heads, gradient ",
                      i, " (causal ", causal, ")");
      }
    }
  };
  return s;
}

OpSweep attention_backward_sweep() {
  OpSweep s{OpId::attention_backward, kFloats, kNonFloat, {}, {}};
  for (const Attn& at : kAttention) {
    Case c;
    c.label = at.label;
    Arg lse = arg({at.shape[0], at.shape[1], at.shape[2]});
    lse.stats = true;
    c.args = {arg(at.shape), arg(at.shape), arg(at.shape), arg(at.shape), arg(at.shape), lse};
    c.attrs.causal = at.causal;
    c.attrs.scale = at.scale;
    const AttentionRef r(at.shape, at.scale, at.causal);
    // out and lse are the forward's of q, k, v.
    c.prepare = [r](Arrays& in, DType) {
      const Arrays fw = r.forward({in[1], in[2], in[3]}, false);
      in[4] = fw[0];
      in[5] = fw[1];
    };
    c.ref = [r](const Arrays& in, DType) { return r.backward(in, false); };
    c.mag = [r](const Arrays& in, DType) { return r.backward(in, true); };
    // One key: the gradients of q and k are 0 up to rounding, which the sharded suite's
    // relative bound cannot compare (the sweep bounds them by their magnitudes).
    c.sharded = at.shape[2] > 1;
    s.cases.push_back(std::move(c));
  }
  return s;
}

// ---- attention_qkv ---------------------------------------------------------------------------
// The reference: the packed tensors taken apart into the [B, H, T, D] heads AttentionRef
// reads and writes, independently of the kernels' views.

struct Packed {
  const char* label;
  int64_t b, t, heads, head_dim;
  bool causal;
  double scale;
  int64_t width() const { return heads * head_dim; }
  Shape qkv() const { return {3, b, t, width()}; }
  Shape rows() const { return {b, t, width()}; }
  Shape stats() const { return {b, heads, t}; }
  AttentionRef ref() const { return AttentionRef({b, heads, t, head_dim}, scale, causal); }
  // [B, T, C] -> [B, H, T, D] and back.
  NdArray split(const NdArray& x) const {
    return ref::permute(ref::reshape(x, {b, t, heads, head_dim}), {0, 2, 1, 3});
  }
  NdArray merge(const NdArray& x) const { return ref::reshape(ref::permute(x, {0, 2, 1, 3}), rows()); }
  // Part i (q, k or v) of qkv as heads.
  NdArray part(const NdArray& qkv, int64_t i) const {
    return split(ref::reshape(ref::slice(qkv, 0, i, i + 1, 1), rows()));
  }
  Arrays forward(const Arrays& in, bool mag) const {
    const Arrays r = ref().forward({part(in[0], 0), part(in[0], 1), part(in[0], 2)}, mag);
    return {merge(r[0]), r[1]};
  }
  // grad, qkv, out, lse -> grad_qkv.
  Arrays backward(const Arrays& in, bool mag) const {
    const Arrays g = ref().backward(
        {split(in[0]), part(in[1], 0), part(in[1], 1), part(in[1], 2), split(in[2]), in[3]}, mag);
    return {ref::stack({merge(g[0]), merge(g[1]), merge(g[2])}, 0)};
  }
};
const Packed kPacked[] = {
    {"[3, 2, 5, 12]: 3 heads of 4, causal", 2, 5, 3, 4, true, 0.0},
    {"[3, 2, 5, 12]: 3 heads of 4, not causal", 2, 5, 3, 4, false, 0.0},
    {"[3, 1, 9, 16]: 2 heads of 8, causal, scale 0.5", 1, 9, 2, 8, true, 0.5},
    // Small enough for the sharded suite (at most 300 values in all inputs, the backward's
    // too), with whole heads per rank when 2 or 4 ranks split the width (4 heads), or 2.
    {"[3, 2, 3, 8]: 4 heads of 2, causal", 2, 3, 4, 2, true, 0.0},
    {"[3, 1, 4, 6]: 2 heads of 3, not causal, scale 0.7", 1, 4, 2, 3, false, 0.7},
    {"[3, 1, 130, 16]: 2 heads of 8, causal, 3 row blocks", 1, 130, 2, 8, true, 0.0},
    {"[3, 2, 70, 5]: one head of 5, not causal, scale -0.3", 2, 70, 1, 5, false, -0.3},
    {"[3, 1, 1, 10]: 2 heads of 5, one query", 1, 1, 2, 5, true, 0.0},
};

OpSweep attention_qkv_sweep() {
  OpSweep s{OpId::attention_qkv, kFloats, kNonFloat, {}, {}};
  for (const Packed& pk : kPacked) {
    Case c;
    c.label = pk.label;
    c.args = {arg(pk.qkv())};
    c.attrs = op_attrs::attention_qkv(pk.head_dim, pk.causal, pk.scale);
    c.ref = [pk](const Arrays& in, DType) { return pk.forward(in, false); };
    c.mag = [pk](const Arrays& in, DType) { return pk.forward(in, true); };
    c.out_dtype = [](DType dt, size_t k) { return k == 0 || dt == DType::f64 ? dt : DType::f32; };
    s.cases.push_back(std::move(c));
  }
  s.extra = [] {
    expect_error("attention_qkv dim 0 of 2", [] { attention_qkv(zeros({2, 1, 3, 8}), 4); });
    expect_error("attention_qkv width 10 for head_dim 4", [] { attention_qkv(zeros({3, 1, 3, 10}), 4); });
    expect_error("attention_qkv head_dim 0", [] { attention_qkv(zeros({3, 1, 3, 8}), 0); });
    expect_error("attention_qkv 3-D qkv", [] { attention_qkv(zeros({3, 3, 8}), 4); });
    expect_error("attention_qkv_backward lse of 3 heads for 2", [] {
      attention_qkv_backward(zeros({1, 3, 8}), zeros({3, 1, 3, 8}), zeros({1, 3, 8}),
                             zeros({1, 3, 3}), 4, true, 0.0);
    });
    // The packed op is the unpacked one on views: its output, lse and gradient are the bits
    // of attention and attention_backward on q, k and v split out of qkv, for T across two
    // row blocks, in f32 and bf16; head dim 64 is one the CUDA tensor-core kernels take (so
    // there they write the strided output and gradients too).
    for (const auto& heads_of : {std::pair<int64_t, int64_t>{3, 8}, {2, 64}}) {
      const int64_t H = heads_of.first, D = heads_of.second;  // (lambdas capture them)
      for (const DType dt : {DType::f32, DType::bf16}) {
        for (const bool causal : {true, false}) {
          constexpr int64_t B = 2, T = 70;
          const int64_t C = H * D;
          const Tensor qkv = randn({3, B, T, C}).cast(dt).to(sweep_device());
          const Tensor dout = randn({B, T, C}).cast(dt).to(sweep_device());
          const auto heads = [&](const Tensor& x) { return transpose(view(x, {B, T, H, D}), 1, 2); };
          const auto merge = [&](const Tensor& x) { return view(transpose(x, 1, 2).contiguous(), {B, T, C}); };
          const auto bits = [](const Tensor& t) {  // raw bytes: -0 and +0 differ
            const Tensor c = t.to(kCPU).contiguous();
            std::vector<uint8_t> out(static_cast<size_t>(c.numel()) * dtype_size(c.dtype()));
            std::memcpy(out.data(), c.raw_data(), out.size());
            return out;
          };
          const std::vector<Tensor> qkv_heads{heads(qkv.select(0, 0)), heads(qkv.select(0, 1)),
                                              heads(qkv.select(0, 2))};
          const std::vector<Tensor> a =
              call(OpId::attention_qkv, {qkv}, op_attrs::attention_qkv(D, causal, 0.0));
          const std::vector<Tensor> b = call(OpId::attention, qkv_heads, op_attrs::attention(causal, 0.0));
          const std::string what = fmt::format("({}, {} heads of {}, causal {})", dtype_name(dt), H, D, causal);
          CHECK_MESSAGE(bits(a[0]) == bits(merge(b[0])), "attention_qkv's output ", what);
          CHECK_MESSAGE(bits(a[1]) == bits(b[1]), "attention_qkv's lse ", what);
          const Tensor ga = attention_qkv_backward(dout, qkv, a[0], a[1], D, causal, 0.0);
          const std::vector<Tensor> gb = attention_backward(heads(dout), qkv_heads[0], qkv_heads[1],
                                                            qkv_heads[2], b[0], b[1], causal, 0.0);
          CHECK_MESSAGE(bits(ga) == bits(stack({merge(gb[0]), merge(gb[1]), merge(gb[2])}, 0)),
                        "attention_qkv_backward ", what);
        }
      }
    }
  };
  return s;
}

OpSweep attention_qkv_backward_sweep() {
  OpSweep s{OpId::attention_qkv_backward, kFloats, kNonFloat, {}, {}};
  for (const Packed& pk : kPacked) {
    Case c;
    c.label = pk.label;
    Arg lse = arg(pk.stats());
    lse.stats = true;
    c.args = {arg(pk.rows()), arg(pk.qkv()), arg(pk.rows()), lse};
    c.attrs = op_attrs::attention_qkv(pk.head_dim, pk.causal, pk.scale);
    // out and lse are the forward's of qkv.
    c.prepare = [pk](Arrays& in, DType) {
      const Arrays fw = pk.forward({in[1]}, false);
      in[2] = fw[0];
      in[3] = fw[1];
    };
    c.ref = [pk](const Arrays& in, DType) { return pk.backward(in, false); };
    c.mag = [pk](const Arrays& in, DType) { return pk.backward(in, true); };
    c.sharded = pk.t > 1;  // as attention_backward's one-key case
    s.cases.push_back(std::move(c));
  }
  return s;
}

}  // namespace

std::vector<OpSweep> attention_sweeps() {
  return {attention_sweep(), attention_backward_sweep(), attention_qkv_sweep(),
          attention_qkv_backward_sweep()};
}

}  // namespace tessera::sweep
