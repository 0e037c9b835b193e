#!/usr/bin/python3
"""PyTorch peer of //tools/bench:cpu_bench: the same operations, sizes, thread count and timing.

    /usr/bin/python3 tools/bench/torch_peer.py --threads 2 --reps 15 --json /tmp/torch_cpu.json

Run it with Debian's /usr/bin/python3 (python3-torch, OpenBLAS); the python3 first on PATH
may be a build without torch. Each figure is the median over --reps timed repetitions after
--warmup untimed ones; a repetition loops a fast operation until it takes >= --min_ms.
Bandwidth counts bytes read + written once each, exactly as cpu_bench.cc does, so the result
names and units line up for tools/bench/run_cpu_bench.sh.
"""

import argparse
import json
import os
import statistics
import sys
import time

torch = None  # imported in main(), after OPENBLAS_NUM_THREADS is set


def median_ms(args, op):
    for _ in range(args.warmup):
        op()
    t0 = time.perf_counter()
    op()
    once = max((time.perf_counter() - t0) * 1e3, 1e-3)
    inner = max(1, int(args.min_ms / once))
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        for _ in range(inner):
            op()
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def blas_library():
    """The BLAS shared library torch loaded (Debian picks it through alternatives)."""
    with open("/proc/self/maps") as maps:
        libs = sorted({line.split()[-1].rsplit("/", 1)[-1] for line in maps
                       if "blas" in line.lower() and "/" in line})
    openblas = [lib for lib in libs if "openblas" in lib]
    return (openblas or libs or ["unknown BLAS"])[0]


def bench_gemm(args, results):
    for n in (256, 512, 1024, 2048):
        a = torch.randn(n, n, dtype=torch.float32)
        b = torch.randn(n, n, dtype=torch.float32)
        ms = median_ms(args, lambda: torch.matmul(a, b))
        results.append({"name": f"matmul_f32_{n}", "unit": "GFLOP/s",
                        "value": 2.0 * n ** 3 / (ms * 1e6), "median_ms": ms, "reps": args.reps})


def bench_linear(args, results):
    """GPT-mini's Linear products x @ W^T and their weight gradients dy^T x (cpu_bench.cc)."""
    for m, k, n in ((2048, 128, 128), (2048, 128, 512), (2048, 512, 128), (2048, 128, 256)):
        x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)
        flops = 2.0 * m * k * n
        ms = median_ms(args, lambda: torch.matmul(x, w.t()))
        results.append({"name": f"matmul_f32_{m}x{k}x{n}_wt", "unit": "GFLOP/s",
                        "value": flops / (ms * 1e6), "median_ms": ms, "reps": args.reps})
        ms = median_ms(args, lambda: torch.matmul(dy.t(), x))
        results.append({"name": f"matmul_f32_{n}x{m}x{k}_dw", "unit": "GFLOP/s",
                        "value": flops / (ms * 1e6), "median_ms": ms, "reps": args.reps})


def bench_memory(args, results):
    n = 1 << 24
    rows = cols = 4096
    f = 4.0
    x = torch.randn(n, dtype=torch.float32)
    y = torch.randn(n, dtype=torch.float32)
    m = torch.randn(rows, cols, dtype=torch.float32)
    cases = [
        ("add_16M", 3 * n * f, lambda: torch.add(x, y)),
        ("mul_scalar_16M", 2 * n * f, lambda: x * 2.0),
        ("exp_16M", 2 * n * f, lambda: torch.exp(x)),
        ("relu_16M", 2 * n * f, lambda: torch.relu(x)),
        ("sum_all_16M", n * f, lambda: torch.sum(x)),
        ("sum_lastdim_4096x4096", (rows * cols + rows) * f, lambda: torch.sum(m, dim=-1)),
        ("softmax_lastdim_4096x4096", 2 * rows * cols * f, lambda: torch.softmax(m, dim=-1)),
    ]
    if args.preallocated:
        # The kernels alone: outputs written into preallocated tensors (out=), so no fresh
        # memory is touched per call. Softmax has no out= form and is left out.
        out = torch.empty(n, dtype=torch.float32)
        row_sums = torch.empty(rows, dtype=torch.float32)
        scalar = torch.empty((), dtype=torch.float32)
        cases = [
            ("add_16M_out", 3 * n * f, lambda: torch.add(x, y, out=out)),
            ("mul_scalar_16M_out", 2 * n * f, lambda: torch.mul(x, 2.0, out=out)),
            ("exp_16M_out", 2 * n * f, lambda: torch.exp(x, out=out)),
            ("relu_16M_out", 2 * n * f, lambda: torch.clamp(x, min=0.0, out=out)),
            ("sum_all_16M_out", n * f, lambda: torch.sum(x, dim=0, out=scalar)),
            ("sum_lastdim_4096x4096_out", (rows * cols + rows) * f,
             lambda: torch.sum(m, dim=-1, out=row_sums)),
        ]
    for name, nbytes, op in cases:
        ms = median_ms(args, op)
        results.append({"name": name, "unit": "GB/s", "value": nbytes / (ms * 1e6),
                        "median_ms": ms, "reps": args.reps})


def bench_attention(args, results):
    """Causal attention at GPT-mini's shape as GPT code writes it in torch 1.13 (no SDPA):
    scores, mask, softmax, product; forward, and forward + backward."""
    B, H, T, D = 16, 4, 128, 32
    q, k, v, dout = (torch.randn(B, H, T, D) for _ in range(4))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scale = 1.0 / D ** 0.5
    product = B * H * T * (T + 1) / 2 * D * 2

    def attend(q, k, v):
        s = (q @ k.transpose(-2, -1)) * scale
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v

    ms = median_ms(args, lambda: attend(q, k, v))
    results.append({"name": "attention_causal_fwd_b16h4t128d32", "unit": "GFLOP/s",
                    "value": 2 * product / (ms * 1e6), "median_ms": ms, "reps": args.reps})
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def step():
        with torch.enable_grad():
            attend(qg, kg, vg).backward(dout)
        for t in (qg, kg, vg):
            t.grad = None

    ms = median_ms(args, step)
    results.append({"name": "attention_causal_fwdbwd_b16h4t128d32", "unit": "GFLOP/s",
                    "value": 6 * product / (ms * 1e6), "median_ms": ms, "reps": args.reps})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min_ms", type=float, default=20.0)
    parser.add_argument("--json", default="")
    parser.add_argument("--only", choices=["gemm", "memory", "attention"], default=None)
    parser.add_argument("--preallocated", action="store_true",
                        help="memory ops write into preallocated outputs (out=): kernels only")
    args = parser.parse_args()

    # Debian's torch calls OpenBLAS (pthreads build), whose pool is sized from this variable
    # when the library loads; torch.set_num_threads covers torch's own OpenMP kernels.
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    global torch
    import torch as torch_module
    torch = torch_module
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    results = []
    if args.only in (None, "gemm"):
        bench_gemm(args, results)
        bench_linear(args, results)
    if args.only in (None, "memory"):
        bench_memory(args, results)
    if args.only in (None, "attention"):
        bench_attention(args, results)

    blas = blas_library()
    print(f"PyTorch {torch.__version__} ({blas}) CPU benchmarks: {torch.get_num_threads()} "
          f"thread(s), median of {args.reps} reps (after {args.warmup} warm-up)")
    print(f"{'operation':<28} {'rate':>12} {'median ms':>12}")
    for r in results:
        print(f"{r['name']:<28} {r['value']:8.1f} {r['unit']:<7} {r['median_ms']:9.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"framework": "pytorch", "version": torch.__version__, "blas": blas,
                       "threads": torch.get_num_threads(), "results": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
