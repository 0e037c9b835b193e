// CUDA matmul through cuBLASLt: f32 (CUBLAS_COMPUTE_32F, or 32F_FAST_TF32 when allow_tf32()),
// f16/bf16 (f32 accumulation, one rounding to the input dtype), f64 (CUBLAS_COMPUTE_64F).
//
//   out [..., m, n] = a [..., m, k] @ b [..., k, n]      (batch dims broadcast; rank >= 2)
//
// Tessera is row-major and cuBLASLt column-major, so the product is computed as
// out^T = b^T a^T: a row-major operand is already its own transpose in column-major terms
// (CUBLAS_OP_N) and a column-major one (x.t(), k.transpose(-2, -1), nn::Linear's weight.t())
// is read with CUBLAS_OP_T, so neither is copied. Batch dims become cuBLASLt's batch count
// and strided batch offset (stride 0 for a broadcast operand); a batched `a` times an
// unbatched `b` (x [B, T, C] @ W^T) is one GEMM with B*T rows. Layouts that fit none of this
// are handled by looping over the outer batch dims or, past a few calls, by copying.
//
// The algorithm is cuBLASLt's first heuristic choice, cached with its descriptors per
// (shape, strides, dtype, transposes, pointer alignment); the workspace is blas.h's. Large
// 16-bit products whose matrices are off 16-byte alignment (GPT-2's 50257-wide head) run on
// aligned copies of them (run_staged, below).
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/cpu/util.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/copy_kernels.cuh"
#include "kernels/cuda/linear.cuh"
#include "kernels/cuda/runtime.h"
#include "tensor/op.h"

namespace tessera::cuda_kernels {
namespace {

// One operand as cuBLASLt stores it: op(stored) is the operand's transpose (see above).
struct LtOperand {
  bool trans = false;      // CUBLAS_OP_T
  int64_t rows = 0, cols = 0, ld = 0;  // the stored column-major matrix
};

// cuBLASLt's view of a row-major-indexed matrix X [r, c] with strides (rs, cs), or false if
// neither stride is 1 (then it must be copied). Strides of size-1 dims are arbitrary, so
// they are normalised first (as kernels/cpu/matmul.cc does).
bool lt_operand(int64_t r, int64_t c, int64_t rs, int64_t cs, LtOperand& op) {
  if (c == 1) cs = 1;
  if (r == 1) rs = std::max<int64_t>(c, 1);
  if (cs == 1 && rs >= std::max<int64_t>(c, 1)) {  // row-major: X^T is column-major
    op = {false, c, r, rs};
    return true;
  }
  if (rs == 1 && cs >= std::max<int64_t>(r, 1)) {  // column-major: read X^T with OP_T
    op = {true, r, c, cs};
    return true;
  }
  return false;
}

// The single stride S with offset(i) = i * S for every flat index i over `sizes` (strides
// `strides`), if there is one. Dims of size 1 do not matter; no dims at all give S = 0.
bool collapse(const int64_t* sizes, const int64_t* strides, size_t n, int64_t& stride) {
  int64_t inner = 1;
  bool known = false;
  stride = 0;
  for (size_t d = n; d-- > 0;) {
    if (sizes[d] == 1) continue;
    if (!known) {
      if (strides[d] % inner != 0) return false;
      stride = strides[d] / inner;
      known = true;
    } else if (strides[d] != stride * inner) {
      return false;
    }
    inner *= sizes[d];
  }
  return true;
}

int alignment_of(const void* p) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && addr % (2 * a) == 0) a *= 2;
  return a;
}

struct GemmKey {
  int device, dtype, compute;
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc, batch, sa, sb;
  int align_a, align_b, align_c;
  bool f32_out;
  bool bias;  // CUBLASLT_EPILOGUE_BIAS (the bias vector in the output's dtype)
  bool operator==(const GemmKey& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};
struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    size_t h = 1469598103934665603ull;  // FNV-1a over the key's bytes (zero-initialised padding)
    for (size_t i = 0; i < sizeof(k); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return h;
  }
};

// A GEMM ready to run: its descriptors and chosen algorithm, built once and kept (the
// descriptors hold no pointers, so any call of the same key may reuse them).
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = true;  // false: cuBLASLt has no algorithm (asked with the bias epilogue only)
  mutable std::mutex bias_mu;  // the bias pointer is the descriptor's: set and launched together
};

cudaDataType_t cuda_dtype(DType dt) {
  switch (dt) {
    case DType::f64: return CUDA_R_64F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

cublasComputeType_t compute_type(DType dt) {
  if (dt == DType::f64) return CUBLAS_COMPUTE_64F;
  if (dt == DType::f32 && allow_tf32()) return CUBLAS_COMPUTE_32F_FAST_TF32;
  return CUBLAS_COMPUTE_32F;
}

// The column-major problem D [m, n] = op(A) [m, k] op(B) [k, n] in cuBLASLt's own terms
// (here m = the output's columns, n = its rows: see the header comment).
struct LtProblem {
  DType dtype;
  int64_t m, n, k;
  LtOperand a, b;
  int64_t batch = 1, stride_a = 0, stride_b = 0;
  bool f32_out = false;  // 16-bit operands, an f32 result (linear's unrounded product)
  const void* bias = nullptr;  // with it, D = A B + bias (a column of m values, D's dtype)
  int64_t ldc = 0;             // D's leading dimension; 0: m (D contiguous)
};

cublasLtMatrixLayout_t make_layout(const LtProblem& p, cudaDataType_t dt, int64_t rows, int64_t cols,
                                   int64_t ld, int64_t stride, Device d) {
  cublasLtMatrixLayout_t l = nullptr;
  cublas_check(cublasLtMatrixLayoutCreate(&l, dt, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
               "matmul", "cublasLtMatrixLayoutCreate", d);
  if (p.batch > 1) {
    const int32_t count = static_cast<int32_t>(p.batch);
    cublas_check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
                 "matmul", "cublasLtMatrixLayoutSetAttribute", d);
    cublas_check(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)),
                 "matmul", "cublasLtMatrixLayoutSetAttribute", d);
  }
  return l;
}

std::unique_ptr<GemmPlan> build_plan(const LtProblem& p, const GemmKey& key, Device d) {
  auto plan = std::make_unique<GemmPlan>();
  const cudaDataType_t dt = cuda_dtype(p.dtype);
  const cudaDataType_t scale = p.dtype == DType::f64 ? CUDA_R_64F : CUDA_R_32F;
  cublas_check(cublasLtMatmulDescCreate(&plan->desc, compute_type(p.dtype), scale), "matmul",
               "cublasLtMatmulDescCreate", d);
  const cublasOperation_t ta = p.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = p.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
               "matmul", "cublasLtMatmulDescSetAttribute", d);
  cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
               "matmul", "cublasLtMatmulDescSetAttribute", d);
  if (key.bias) {
    // The bias is added to the f32 accumulator before the one conversion to D's dtype.
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                                sizeof(epilogue)),
                 "linear", "cublasLtMatmulDescSetAttribute", d);
    const cudaDataType_t bias_dt = p.f32_out ? CUDA_R_32F : dt;
    cublas_check(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_dt,
                                                sizeof(bias_dt)),
                 "linear", "cublasLtMatmulDescSetAttribute", d);
  }
  plan->a = make_layout(p, dt, p.a.rows, p.a.cols, p.a.ld, p.stride_a, d);
  plan->b = make_layout(p, dt, p.b.rows, p.b.cols, p.b.ld, p.stride_b, d);
  const int64_t ldc = p.ldc > 0 ? p.ldc : p.m;
  plan->c = make_layout(p, p.f32_out ? CUDA_R_32F : dt, p.m, p.n, ldc, ldc * p.n, d);

  cublasLtMatmulPreference_t pref = nullptr;
  cublas_check(cublasLtMatmulPreferenceCreate(&pref), "matmul", "cublasLtMatmulPreferenceCreate", d);
  const uint64_t ws = lt_workspace(d).bytes;
  const uint32_t al_a = key.align_a, al_b = key.align_b, al_c = key.align_c;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(d), plan->desc, plan->a, plan->b,
                                                          plan->c, plan->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (key.bias && (s != CUBLAS_STATUS_SUCCESS || found == 0)) {
    plan->found = false;  // the caller adds the bias itself
    return plan;
  }
  cublas_check(s, "matmul", "cublasLtMatmulAlgoGetHeuristic", d);
  TS_CHECK(found > 0, "matmul: cuBLASLt has no algorithm for {} [{} x {} x {}], batch {}, transposes {}/{}",
           dtype_name(p.dtype), p.n, p.m, p.k, p.batch, p.b.trans, p.a.trans);
  plan->algo = result.algo;
  return plan;
}

const GemmPlan& plan_for(const LtProblem& p, const void* a, const void* b, void* c, Device d) {
  GemmKey key;
  std::memset(&key, 0, sizeof(key));  // padding bytes take part in == and the hash
  key.device = d.index;
  key.dtype = static_cast<int>(p.dtype);
  key.compute = static_cast<int>(compute_type(p.dtype));
  key.ta = p.a.trans;
  key.tb = p.b.trans;
  key.m = p.m;
  key.n = p.n;
  key.k = p.k;
  key.lda = p.a.ld;
  key.ldb = p.b.ld;
  key.ldc = p.ldc > 0 ? p.ldc : p.m;
  key.batch = p.batch;
  key.sa = p.stride_a;
  key.sb = p.stride_b;
  key.align_a = alignment_of(a);
  key.align_b = alignment_of(b);
  key.align_c = alignment_of(c);
  key.f32_out = p.f32_out;
  key.bias = p.bias != nullptr;
  static std::mutex mu;
  static auto* plans = new std::unordered_map<GemmKey, std::unique_ptr<GemmPlan>, GemmKeyHash>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans->find(key);
  if (it == plans->end()) it = plans->emplace(key, build_plan(p, key, d)).first;
  return *it->second;
}

// With p.bias: false (nothing launched) where cuBLASLt has no algorithm for the bias epilogue.
bool run_gemm(const LtProblem& p, const void* a, const void* b, void* c, Device d) {
  const GemmPlan& plan = plan_for(p, a, b, c, d);
  if (!plan.found) return false;
  const Workspace ws = lt_workspace(d);
  const double one_d = 1.0, zero_d = 0.0;
  const float one_f = 1.0f, zero_f = 0.0f;
  const bool f64 = p.dtype == DType::f64;
  const void* alpha = f64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* beta = f64 ? static_cast<const void*>(&zero_d) : &zero_f;
  std::unique_lock<std::mutex> lock(plan.bias_mu, std::defer_lock);
  if (p.bias != nullptr) {
    lock.lock();
    cublas_check(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                                sizeof(p.bias)),
                 "linear", "cublasLtMatmulDescSetAttribute", d);
  }
  cublas_check(cublasLtMatmul(cublaslt_handle(d), plan.desc, alpha, a, plan.a, b, plan.b, beta, c, plan.c, c,
                              plan.c, &plan.algo, ws.ptr, ws.bytes, compute_stream(d)),
               "matmul", "cublasLtMatmul", d);
  return true;
}

// `t` broadcast to batch + its last two dims, as a view with stride 0 on expanded dims
// (built directly from the storage: no op, no autograd).
Tensor broadcast_view(const Tensor& t, const Shape& batch) {
  Shape shape = batch;
  shape.push_back(t.shape()[t.dim() - 2]);
  shape.push_back(t.shape()[t.dim() - 1]);
  return Tensor::from_storage(t.storage(), shape, broadcast_strides(t.shape(), t.strides(), shape), t.offset(),
                              t.dtype());
}

// Calls fn(outer) for every index over batch dims [0, split), in row-major order.
template <typename F>
void for_each_outer(const Shape& batch, size_t split, F&& fn) {
  int64_t count = 1;
  for (size_t i = 0; i < split; ++i) count *= batch[i];
  for (int64_t i = 0; i < count; ++i) fn(i);
}

// Offset in elements of outer batch index `outer` (over dims [0, split)) for strides `s`.
int64_t outer_offset(const Shape& batch, const Strides& s, size_t split, int64_t outer) {
  int64_t off = 0;
  for (size_t d = split; d-- > 0;) {
    off += (outer % batch[d]) * s[d];
    outer /= batch[d];
  }
  return off;
}

// More separate GEMM calls than this over the outer batch dims and the operands that do not
// collapse to one batch stride are copied instead.
constexpr int64_t kMaxOuterCalls = 16;

// ---- 16-bit products with unaligned leading dimensions ---------------------------------------
// cuBLASLt's fast Hopper kernels (TMA loads and stores) need every matrix's leading dimension
// and pointer 16-byte aligned; a 16-bit matrix whose row holds a number of elements that is
// not a multiple of 8 (GPT-2's 50,257-wide logits and their gradient) gets the older kernels:
// the LM head's three GEMMs ran at 120-152 TFLOP/s on an H200 against 701-848 with 50,304
// rows (BENCHMARKS.md, 2026-11-27). A large enough product therefore runs on staged copies:
// each unaligned operand copied to a buffer whose leading dimension is rounded up to 8
// (launch_repitch16), the product written to such a buffer and copied back. The values are
// the same; the algorithm (so the last bits) is the one cuBLASLt picks for aligned matrices.
// Staged when the product has at least kStageMinFlops, and kStageFlopsPerByte FLOPs for each
// byte the copies move (read + write). At the rates above a FLOP costs ~6.3 fs less aligned,
// and a byte copied at ~2.5 TB/s ~0.4 ps: even at ~63 FLOPs per byte; 128 leaves 2x margin.
// Those figures are estimates, not yet measured with this kernel: an earlier try through
// cudaMemcpy2DAsync was slower overall (its pitched copies, BENCHMARKS.md). GPT-2's head
// has ~350 FLOPs per copied byte in each of its three GEMMs under autocast (the logits or
// their gradient, [8192, 50257]; since autocast casts the tied weight in its own layout,
// [50257, 768] read as transposed, the weight's leading dimension is 768, aligned).
// TESSERA_CUDA_STAGE_UNALIGNED=0 (or set_stage_unaligned_gemms(false)) turns staging off.
constexpr double kStageMinFlops = 1e9;
constexpr double kStageFlopsPerByte = 128;

std::atomic<int>& stage_flag() {
  static std::atomic<int> flag{[] {
    const char* v = std::getenv("TESSERA_CUDA_STAGE_UNALIGNED");
    return v != nullptr && std::strcmp(v, "0") == 0 ? 0 : 1;
  }()};
  return flag;
}

std::atomic<int64_t> g_staged{0};  // staged_gemm_count()

bool misaligned16(int64_t ld, const void* ptr) { return (ld * 2) % 16 != 0 || alignment_of(ptr) < 16; }

int64_t round_up8(int64_t x) { return (x + 7) / 8 * 8; }

// Runs p (one GEMM: batch 1, no bias, D in the operands' 16-bit dtype) on staged copies if
// it is worth it (above); false when not staged (nothing run). a_ptr / b_ptr are cuBLASLt's
// A and B (our b and a), c_ptr D with leading dimension p.m.
bool run_staged(LtProblem p, const void* a_ptr, const void* b_ptr, void* c_ptr, Device d) {
  const bool half = p.dtype == DType::f16 || p.dtype == DType::bf16;
  if (!half || p.batch != 1 || p.f32_out || p.bias != nullptr || stage_flag().load() == 0) return false;
  const bool sa = misaligned16(p.a.ld, a_ptr), sb = misaligned16(p.b.ld, b_ptr), sc = misaligned16(p.m, c_ptr);
  if (!sa && !sb && !sc) return false;
  const double flops = 2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
  double bytes = 0;  // read + write by the copies
  if (sa) bytes += 4.0 * static_cast<double>(p.a.rows) * static_cast<double>(p.a.cols);
  if (sb) bytes += 4.0 * static_cast<double>(p.b.rows) * static_cast<double>(p.b.cols);
  if (sc) bytes += 4.0 * static_cast<double>(p.m) * static_cast<double>(p.n);
  if (flops < kStageMinFlops || flops < kStageFlopsPerByte * bytes) return false;
  const cudaStream_t stream = compute_stream(d);
  // Each buffer lives until the end of this call: freed, the caching allocator hands it out
  // again only to work queued after the GEMM on the same stream.
  auto stage = [&](LtOperand& op, const void*& ptr) {
    const int64_t ld = round_up8(op.rows);
    Tensor buf = Tensor::empty({ld * op.cols}, p.dtype, d);
    run_launch("matmul", d,
               [&] { launch_repitch16(buf.raw_data(), ld, ptr, op.ld, op.rows, op.cols, stream); });
    op.ld = ld;
    ptr = buf.raw_data();
    return buf;
  };
  Tensor a_buf, b_buf, c_buf;
  if (sa) a_buf = stage(p.a, a_ptr);
  if (sb) b_buf = stage(p.b, b_ptr);
  void* out = c_ptr;
  if (sc) {
    p.ldc = round_up8(p.m);
    c_buf = Tensor::empty({p.ldc * p.n}, p.dtype, d);
    out = c_buf.raw_data();
  }
  run_gemm(p, a_ptr, b_ptr, out, d);
  if (sc) run_launch("matmul", d, [&] { launch_repitch16(c_ptr, p.m, out, p.ldc, p.m, p.n, stream); });
  g_staged.fetch_add(1);
  return true;
}

void matmul_kernel(std::span<const Tensor> in, std::span<Tensor> out_span, const Attrs&) {
  const Tensor& o = out_span[0];
  const Device d = o.device();
  if (o.numel() == 0) return;
  DeviceGuard guard(d);
  Tensor a = in[0], b = in[1];
  const int64_t m = o.shape()[o.dim() - 2], n = o.shape()[o.dim() - 1];
  const int64_t k = a.shape()[a.dim() - 1];
  if (k == 0) {
    cuda_check(cudaMemsetAsync(o.raw_data(), 0, static_cast<size_t>(o.nbytes()), compute_stream(d)),
               "matmul (zero fill)", d);
    return;
  }
  const Shape batch(o.shape().begin(), o.shape().end() - 2);
  const size_t nbd = batch.size();

  LtOperand la, lb;  // a [m, k] and b [k, n] in cuBLASLt's terms
  auto layout = [&](Tensor& t, int64_t r, int64_t c, LtOperand& op) {
    const int64_t nd = t.dim();
    if (!lt_operand(r, c, t.strides()[nd - 2], t.strides()[nd - 1], op)) {
      t = contiguous_cuda(t);
      lt_operand(r, c, t.strides()[nd - 2], t.strides()[nd - 1], op);
    }
  };
  layout(a, m, k, la);
  layout(b, k, n, lb);

  // Batch strides of each operand broadcast to the output's batch dims.
  auto batch_strides = [&](const Tensor& t) {
    const Shape tb(t.shape().begin(), t.shape().end() - 2);
    const Strides ts(t.strides().begin(), t.strides().end() - 2);
    return broadcast_strides(tb, ts, batch);
  };
  Strides sa = batch_strides(a), sb = batch_strides(b);
  int64_t stride_a = 0, stride_b = 0;
  // The fewest outer dims to loop over so that the rest collapse to one stride per operand.
  size_t split = 0;
  while (split < nbd && !(collapse(batch.data() + split, sa.data() + split, nbd - split, stride_a) &&
                          collapse(batch.data() + split, sb.data() + split, nbd - split, stride_b))) {
    ++split;
  }
  if (split == nbd) stride_a = stride_b = 0;  // one product per call
  int64_t outer_calls = 1;
  for (size_t i = 0; i < split; ++i) outer_calls *= batch[i];
  if (outer_calls > kMaxOuterCalls) {
    // Copy the operand(s) that do not collapse into [batch..., r, c] (contiguous).
    for (Tensor* t : {&a, &b}) {
      Strides s = batch_strides(*t);
      int64_t unused = 0;
      if (!collapse(batch.data(), s.data(), nbd, unused)) *t = contiguous_cuda(broadcast_view(*t, batch));
    }
    layout(a, m, k, la);
    layout(b, k, n, lb);
    sa = batch_strides(a);
    sb = batch_strides(b);
    split = 0;
    collapse(batch.data(), sa.data(), nbd, stride_a);
    collapse(batch.data(), sb.data(), nbd, stride_b);
  }
  int64_t inner_batch = 1;
  for (size_t i = split; i < nbd; ++i) inner_batch *= batch[i];

  // out^T [n, m] = b^T [n, k] @ a^T [k, m]: cuBLASLt's A is our b, its B our a.
  LtProblem p{a.dtype(), n, m, k, lb, la, inner_batch, stride_b, stride_a};
  if (inner_batch > 1 && stride_b == 0 && !la.trans && stride_a == m * la.ld) {
    // A batched row-major a times a shared b: the batches' rows follow each other at a
    // constant stride, so they are one [inner_batch * m, k] operand and one GEMM.
    p.n = inner_batch * m;
    p.b.cols = p.n;
    p.batch = 1;
    p.stride_a = p.stride_b = 0;
  }
  TS_CHECK(p.batch <= INT32_MAX, "matmul: batch of {} products is more than cuBLASLt takes", p.batch);
  const size_t es = static_cast<size_t>(dtype_size(a.dtype()));
  const char* ap = static_cast<const char*>(a.raw_data());
  const char* bp = static_cast<const char*>(b.raw_data());
  char* op = static_cast<char*>(o.raw_data());
  if (split == 0 && run_staged(p, bp, ap, op, d)) return;
  for_each_outer(batch, split, [&](int64_t outer) {
    run_gemm(p, bp + outer_offset(batch, sb, split, outer) * es, ap + outer_offset(batch, sa, split, outer) * es,
             op + outer * inner_batch * m * n * es, d);
  });
}

TS_REGISTER_KERNEL(cuda, matmul, matmul_kernel);

// ---- grouped matmul (Mixture of Experts) ----------------------------------------------------
// One cuBLASLt GEMM per non-empty group, on the compute stream, with the operands read at
// their strides (a transposed expert weight with OP_T). The group sizes are read on the host
// (a synchronisation: the routing's counts decide the products' shapes).

// out [r, c] (row-major, ld c) = A [r, k] (strides ars, acs) @ B [k, c] (strides brs, bcs).
// out [r, c] = a [r, k] @ b [k, c] (+ bias [c], when given and cuBLASLt has the epilogue for
// it: returns false, nothing run, where it has not).
bool gemm_2d(DType dt, const char* a, int64_t ars, int64_t acs, const char* b, int64_t brs, int64_t bcs,
             char* out, int64_t r, int64_t c, int64_t k, Device d, bool f32_out = false,
             const void* bias = nullptr) {
  LtOperand la, lb;
  TS_CHECK(lt_operand(r, k, ars, acs, la) && lt_operand(k, c, brs, bcs, lb),
           "grouped_matmul (CUDA): operands with strides ({}, {}) and ({}, {}) need a copy", ars, acs,
           brs, bcs);
  LtProblem p{dt, c, r, k, lb, la, 1, 0, 0, f32_out};
  p.bias = bias;
  return run_gemm(p, b, a, out, d);
}

void grouped_matmul_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& o = out[0];
  const Device d = o.device();
  DeviceGuard guard(d);
  const std::vector<int64_t> starts = cpu::group_starts("grouped_matmul", in[2], in[0].shape()[0]);
  Tensor x = in[0], w = in[1];
  const int64_t K = x.shape()[1], M = w.shape()[2];
  // x's groups are row blocks of it, each read as its own matrix: row-major rows (unit column
  // stride, row stride >= K) keep every block readable, whatever its size; anything else (a
  // transposed x, broadcast rows with row stride 0) is copied once. Each expert's [K, M]
  // block of w is readable as it is unless neither stride is 1.
  LtOperand probe;
  if (!((x.strides()[1] == 1 || K <= 1) && x.strides()[0] >= std::max<int64_t>(K, 1))) {
    x = contiguous_cuda(x);
  }
  if (!lt_operand(K, M, w.strides()[1], w.strides()[2], probe)) w = contiguous_cuda(w);
  const size_t es = static_cast<size_t>(dtype_size(x.dtype()));
  if (K == 0 && o.numel() > 0) {
    cuda_check(cudaMemsetAsync(o.raw_data(), 0, static_cast<size_t>(o.nbytes()), compute_stream(d)),
               "grouped_matmul (zero fill)", d);
    return;
  }
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    const int64_t r0 = starts[e], rows = starts[e + 1] - r0;
    if (rows == 0 || M == 0) continue;
    gemm_2d(x.dtype(), static_cast<const char*>(x.raw_data()) + r0 * x.strides()[0] * es, x.strides()[0],
            x.strides()[1], static_cast<const char*>(w.raw_data()) + static_cast<int64_t>(e) * w.strides()[0] * es,
            w.strides()[1], w.strides()[2], static_cast<char*>(o.raw_data()) + r0 * M * es, rows, M, K, d);
  }
}

void grouped_matmul_backward_weight_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs&) {
  const Tensor& o = out[0];
  const Device d = o.device();
  DeviceGuard guard(d);
  const std::vector<int64_t> starts =
      cpu::group_starts("grouped_matmul_backward_weight", in[2], in[0].shape()[0]);
  const Tensor x = contiguous_cuda(in[0]), g = contiguous_cuda(in[1]);
  const int64_t K = x.shape()[1], M = g.shape()[1];
  const size_t es = static_cast<size_t>(dtype_size(x.dtype()));
  if (o.numel() == 0) return;
  cuda_check(cudaMemsetAsync(o.raw_data(), 0, static_cast<size_t>(o.nbytes()), compute_stream(d)),
             "grouped_matmul_backward_weight (zero fill)", d);
  for (size_t e = 0; e + 1 < starts.size(); ++e) {
    const int64_t r0 = starts[e], rows = starts[e + 1] - r0;
    if (rows == 0) continue;  // its block stays zero
    // dw[e] [K, M] = x_e^T [K, rows] @ g_e [rows, M]: x_e^T is column-major (strides 1, K).
    gemm_2d(x.dtype(), static_cast<const char*>(x.raw_data()) + r0 * K * es, 1, K,
            static_cast<const char*>(g.raw_data()) + r0 * M * es, M, 1,
            static_cast<char*>(o.raw_data()) + static_cast<int64_t>(e) * K * M * es, K, M, rows, d);
  }
}

// ---- linear ------------------------------------------------------------------------------
// The product x [rows, K] @ w^T through cuBLASLt (w [N, K] read with its strides: W^T is
// column-major for a contiguous w). With a bias (f32, f16, bf16), cuBLASLt's bias epilogue
// adds it to the f32 accumulator and rounds once, writing y, or with an activation the
// pre-activation, which one pass (linear.cu) then activates into y. Otherwise (f64, or no
// algorithm with the epilogue) the GEMM writes an f32 buffer for 16-bit products, or the
// output itself, and one pass adds the bias and activates, with the same single rounding.

void linear_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const Tensor& y = out[0];
  if (y.numel() == 0) return;
  const Device d = y.device();
  DeviceGuard guard(d);
  Tensor x = in[0], w = in[1];
  Tensor b = in[2].defined() ? contiguous_cuda(in[2]) : Tensor();
  const int64_t K = x.shape().back(), N = w.shape()[0], rows = y.numel() / N;
  const int act = static_cast<int>(attrs.activation);
  const Tensor& pre = act != 0 ? out[1] : y;  // what the GEMM (with its bias) writes
  int64_t rs = 0;
  if (K > 0) {
    LtOperand probe;
    if (!cpu::row_stride_of(x, rs) || !lt_operand(rows, K, rs, x.strides().back(), probe)) {
      x = contiguous_cuda(x);
      cpu::row_stride_of(x, rs);
    }
    if (!lt_operand(K, N, w.strides()[1], w.strides()[0], probe)) w = contiguous_cuda(w);
  }
  auto gemm = [&](const Tensor& into, const void* bias) {
    return gemm_2d(x.dtype(), static_cast<const char*>(x.raw_data()), rs, x.strides().back(),
                   static_cast<const char*>(w.raw_data()), w.strides()[1], w.strides()[0],
                   static_cast<char*>(into.raw_data()), rows, N, K, d,
                   /*f32_out=*/into.dtype() != x.dtype(), bias);
  };
  if (b.defined() && K > 0 && x.dtype() != DType::f64) {
    if (reinterpret_cast<uintptr_t>(b.raw_data()) % 16 != 0) {  // a view into a larger buffer
      Tensor aligned = Tensor::empty(b.shape(), b.dtype(), d);
      copy_cuda(aligned, b);
      b = aligned;
    }
    if (gemm(pre, b.raw_data())) {
      if (act != 0) {
        const DevTensor pd = dev_tensor(pre), yd = dev_tensor(y);
        run_launch("linear", d, [&] { launch_act(pd, yd, rows * N, act, compute_stream(d)); });
      }
      return;
    }
  }
  const bool epilogue = b.defined() || act != 0;
  // With a bias or an activation, 16-bit products go to an f32 buffer (one rounding, after
  // the bias, as on the CPU); f32/f64 ones to the output the pass rewrites.
  const bool half = x.dtype() == DType::f16 || x.dtype() == DType::bf16;
  const Tensor acc = epilogue && half ? Tensor::empty(y.shape(), DType::f32, d) : pre;
  if (K == 0) {
    cuda_check(cudaMemsetAsync(acc.raw_data(), 0, static_cast<size_t>(acc.nbytes()), compute_stream(d)),
               "linear (zero fill)", d);
  } else {
    gemm(acc, nullptr);
  }
  if (epilogue) {
    const DevTensor ad = dev_tensor(acc), yd = dev_tensor(y);
    const DevTensor pd = act != 0 ? dev_tensor(out[1]) : DevTensor{};
    const DevTensor bd = b.defined() ? dev_tensor(b) : DevTensor{};
    run_launch("linear", d, [&] { launch_bias_act(ad, pd, yd, bd, rows, N, act, compute_stream(d)); });
  }
}

// Inputs: grad, pre [..., N]. Outputs: grad_pre [..., N], grad_bias [N].
void linear_act_backward_kernel(std::span<const Tensor> in, std::span<Tensor> out, const Attrs& attrs) {
  const Device d = in[0].device();
  DeviceGuard guard(d);
  const Tensor g = contiguous_cuda(in[0]), pre = contiguous_cuda(in[1]);
  const int64_t N = g.shape().back(), rows = N == 0 ? 0 : g.numel() / N;
  const Tensor ws = Tensor::empty({std::max<int64_t>(linear_act_backward_workspace_bytes(rows, N), 1)},
                                  DType::b8, d);
  const DevTensor dd = dev_tensor(out[0]), bd = dev_tensor(out[1]), gd = dev_tensor(g), pd = dev_tensor(pre);
  run_launch("linear_act_backward", d, [&] {
    launch_linear_act_backward(dd, bd, gd, pd, rows, N, static_cast<int>(attrs.activation), ws.raw_data(),
                               compute_stream(d));
  });
}

TS_REGISTER_KERNEL(cuda, grouped_matmul, grouped_matmul_kernel);
TS_REGISTER_KERNEL(cuda, grouped_matmul_backward_weight, grouped_matmul_backward_weight_kernel);
TS_REGISTER_KERNEL(cuda, linear, linear_kernel);
TS_REGISTER_KERNEL(cuda, linear_act_backward, linear_act_backward_kernel);

}  // namespace
}  // namespace tessera::cuda_kernels

namespace tessera::cuda_kernels {
void set_stage_unaligned_gemms(bool on) { stage_flag().store(on ? 1 : 0); }
bool stage_unaligned_gemms() { return stage_flag().load() != 0; }
int64_t staged_gemm_count() { return g_staged.load(); }
}  // namespace tessera::cuda_kernels
