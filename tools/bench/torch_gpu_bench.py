"""PyTorch's side of the GPU benchmark (tools/bench/gpu_bench.cc is Tessera's): the same
ceilings, op shapes and models on the same GPU, timed the same way.

  ceilings     device-to-device copy (GB/s, read + write), bf16 GEMM 8192^3
  matmul       torch.matmul TFLOP/s: f32 (TF32 off / on), bf16, f16 at 4096^3, 8192^3 and
               GPT-2 124M's shapes ([8192,768]x[768,2304], [8192,768]x[768,3072],
               [8192,3072]x[3072,768], [8192,768]x[768,50257])
  elementwise  add of two 256 MiB f32 tensors, gelu (tanh), clone, bf16 add (GB/s); copies
               that are not one memcpy (heads permute, qkv slice, transpose, cast)
  adamw        torch.optim.AdamW(fused=True) and (foreach=True) over GPT-2 124M's 148
               parameter tensors, f32, 28 bytes/param read + written
  attention    F.scaled_dot_product_attention causal bf16, B=8 H=12 T=1024 D=64, fwd, fwd+bwd
  gpt2         GPT-2 124M training (vocab 50257, context 1024, batch 8, tied embeddings,
               pre-LN, GELU tanh, fused qkv, SDPA attention) in bf16 autocast with fused AdamW
               and gradient clipping at 1.0, on random tokens built on the CPU and copied per
               step: tokens/s and MFU, eager and torch.compile
  mnist        models/mnist's CNN (Conv 32, pool, Conv 64, pool, FC 128, FC 10), f32 with TF32
               off (Tessera's default), batch 128, AdamW: samples/s

Op rows use CUDA events around each call (warm-up calls, then the median of --reps calls);
training rows time whole steps ending in loss.item() (a synchronisation), as Tessera's loop.
MFU = (6 N + 12 L T C) * tokens/s / 989e12: N = 124,439,808 parameters (the tied head once),
the attention term per token as PaLM's appendix, 989 TFLOP/s = the H100 SXM's dense bf16 peak.

    python3 tools/bench/torch_gpu_bench.py --json=/tmp/torch_gpu.jsonl [--only=gpt2]

Prints a markdown table on stdout; with --json, one JSON line per row.
"""
import argparse
import gzip
import json
import math
import os
import statistics
import struct
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

H100_BF16_PEAK = 989e12
ROWS = []


def row(group, op, shape, dtype, ms=0.0, tflops=0.0, gbps=0.0, note="", **extra):
    r = dict(framework="pytorch", group=group, op=op, shape=shape, dtype=dtype, ms=ms,
             tflops=tflops, gbps=gbps, note=note, **extra)
    ROWS.append(r)
    print(f"{group:12s} {op:36s} {dtype:6s} {ms:9.3f} ms {note}", file=sys.stderr, flush=True)
    return r


def median_ms(fn, reps, warmup):
    """Median time (ms) of one call of fn(i), CUDA events around each timed call."""
    call = 0
    for _ in range(warmup):
        fn(call)
        call += 1
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn(call)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
        call += 1
    return statistics.median(times)


def rotation(bytes_per_set):
    """Copies of an input enough to pass 2x the 50 MB L2, at most 8."""
    return max(1, min(8, -(-(100 << 20) // bytes_per_set)))


# ---- ops ------------------------------------------------------------------------------------

def bench_copy(a):
    nbytes = 1 << 30
    x = torch.empty(nbytes // 4, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda i: y.copy_(x), a.reps, a.warmup)
    gbps = 2 * nbytes / (ms * 1e6)
    row("copy", "tensor.copy_ D2D", "1 GiB", "bytes", ms=ms, gbps=gbps)
    return gbps


MATMUL_SHAPES = [((4096, 4096), (4096, 4096)), ((8192, 8192), (8192, 8192)),
                 ((8192, 768), (768, 2304)), ((8192, 768), (768, 3072)),
                 ((8192, 3072), (3072, 768)), ((8192, 768), (768, 50257))]


def bench_matmul(a):
    kinds = [("f32", torch.float32, False), ("tf32", torch.float32, True),
             ("bf16", torch.bfloat16, False), ("f16", torch.float16, False)]
    for label, dtype, tf32 in kinds:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for sa, sb in MATMUL_SHAPES:
            esize = torch.tensor([], dtype=dtype).element_size()
            n = rotation((sa[0] * sa[1] + sb[0] * sb[1]) * esize)
            xs = [torch.randn(sa, device="cuda").to(dtype) for _ in range(n)]
            ws = [(torch.randn(sb, device="cuda") * 0.05).to(dtype) for _ in range(n)]
            ms = median_ms(lambda i: torch.matmul(xs[i % n], ws[i % n]), a.reps, a.warmup)
            tflops = 2 * sa[0] * sa[1] * sb[1] / (ms * 1e9)
            name = f"[{sa[0]}x{sa[1]}]x[{sb[0]}x{sb[1]}]"
            row("matmul", name, f"{n} set(s)", label, ms=ms, tflops=tflops)
            del xs, ws
    torch.backends.cuda.matmul.allow_tf32 = False


def bench_elementwise(a, ceiling):
    n = (256 << 20) // 4
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    cases = [("add(a, b)", "f32", 3, lambda i: torch.add(x, y)),
             ("gelu(a) tanh", "f32", 2, lambda i: F.gelu(x, approximate="tanh")),
             ("clone(a)", "f32", 2, lambda i: x.clone())]
    xb, yb = x.to(torch.bfloat16), y.to(torch.bfloat16)
    cases.append(("add(a, b)", "bf16", 3, lambda i: torch.add(xb, yb)))
    for name, label, tensors, fn in cases:
        ms = median_ms(fn, a.reps, a.warmup)
        esize = 2 if label == "bf16" else 4
        gbps = tensors * n * esize / (ms * 1e6)
        row("elementwise", name, f"{n} elems", label, ms=ms, gbps=gbps,
            note=f"{100 * gbps / ceiling:.0f}% of copy")
    del x, y, xb, yb
    # Tessera's copy rows (gpu_bench.cc strided_copies): the same shapes, bytes read + written,
    # sources rotated over copies enough to pass 2x the L2.
    B, T, H, D = 8, 1024, 12, 64
    C = H * D
    copies = [("heads [B,T,H,D] -> [B,H,T,D]", "8x1024x12x64", (B, T, H, D), torch.bfloat16,
               lambda x: x.permute(0, 2, 1, 3), torch.bfloat16),
              ("qkv columns [B,T,3C] -> [B,T,C]", "8x1024x2304", (B, T, 3 * C), torch.bfloat16,
               lambda x: x[:, :, C:2 * C], torch.bfloat16),
              ("transpose [BT,C] -> [C,BT]", "8192x768", (B * T, C), torch.float32, lambda x: x.t(), torch.float32),
              ("cast f32 -> bf16", "8192x768", (B * T, C), torch.float32, lambda x: x, torch.bfloat16)]
    for name, shape, base, dtype, view, out_dtype in copies:
        esize = torch.empty(0, dtype=dtype).element_size()
        out_esize = torch.empty(0, dtype=out_dtype).element_size()
        numel = math.prod(base)
        srcs = [view(torch.randn(base, device="cuda").to(dtype))
                for _ in range(rotation(numel * (esize + out_esize)))]
        ms = median_ms(lambda i: srcs[i % len(srcs)].to(out_dtype).contiguous(), a.reps, a.warmup)
        gbps = srcs[0].numel() * (esize + out_esize) / (ms * 1e6)
        label = "bf16" if dtype == torch.bfloat16 else "f32"
        row("copy", name, shape, label, ms=ms, gbps=gbps, note=f"{100 * gbps / ceiling:.0f}% of copy")
        del srcs


def gpt2_shapes():
    C, V, T = 768, 50257, 1024
    shapes = [(V, C), (T, C)]
    for _ in range(12):
        shapes += [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,),
                   (C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
    return shapes + [(C,), (C,)]


def bench_adamw(a, ceiling):
    for impl in ("fused", "foreach"):
        params = []
        for s in gpt2_shapes():
            p = torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02)
            p.grad = torch.randn(s, device="cuda") * 1e-3
            params.append(p)
        count = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                **{impl: True})
        ms = median_ms(lambda i: opt.step(), a.reps, a.warmup)
        gbps = 28 * count / (ms * 1e6)
        row("adamw", f"AdamW({impl}=True), {len(params)} tensors", f"{count} params", "f32",
            ms=ms, gbps=gbps, note=f"{100 * gbps / ceiling:.0f}% of copy")
        del opt, params


def bench_attention(a):
    B, H, T, D = 8, 12, 1024, 64
    fwd_flops = 4 * B * H * T * T * D / 2  # causal: half the scores
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        ms = median_ms(lambda i: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       a.reps, a.warmup)
    shape = f"B{B} H{H} T{T} D{D}"
    row("attention", "SDPA forward, causal", shape, "bf16", ms=ms, tflops=fwd_flops / (ms * 1e9))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)

    def fwd_bwd(i):
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

    ms = median_ms(fwd_bwd, a.reps, a.warmup)
    row("attention", "SDPA forward + backward, causal", shape, "bf16", ms=ms,
        tflops=3.5 * fwd_flops / (ms * 1e9))


# ---- GPT-2 124M ---------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, layers, heads, width, context, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        for name, p in self.named_parameters():  # GPT-2 init, as models/gpt
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif name.endswith(".weight") and p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias") and "ln_" not in name:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def gpt2_flops_per_token(n_params, layers, context, width):
    return 6 * n_params + 12 * layers * context * width


def bench_gpt2(a, compiled):
    L, H, C, T, V, B = 12, 12, 768, 1024, 50257, a.gpt_batch
    # --gpt_vocab_pad: the embedding's rows rounded up (nanoGPT's 50304), tokens still in
    # [0, V); the extra logits are not masked (they learn to be small), as in nanoGPT.
    rows = -(-V // a.gpt_vocab_pad) * a.gpt_vocab_pad
    torch.manual_seed(0)
    model = Gpt2(L, H, C, T, rows).cuda().train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    step_fn = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(0)
    times, compile_s = [], 0.0
    total = a.gpt_warmup + a.gpt_steps
    for step in range(total):
        t0 = time.perf_counter()
        w = torch.randint(0, V, (B, T + 1), generator=gen)  # built on the CPU, as Tessera's
        idx, targets = w[:, :-1].cuda(), w[:, 1:].cuda()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(idx, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        dt = time.perf_counter() - t0
        if step == 0:
            compile_s = dt
        if step >= a.gpt_warmup:
            times.append(dt)
    tps = len(times) * B * T / sum(times)
    flops = gpt2_flops_per_token(n_params, L, T, C)
    mfu = flops * tps / H100_BF16_PEAK
    mode = "torch.compile" if compiled else "eager"
    if rows != V:
        mode += f", vocab rows {rows}"
    row("gpt2", f"GPT-2 124M train step, {mode}", f"B{B} T{T} V{rows}", "bf16",
        ms=1e3 * statistics.median(times), tokens_per_s=tps, mfu=mfu, params=n_params,
        note=f"{tps:,.0f} tokens/s, MFU {100 * mfu:.1f}%, loss {loss_value:.3f}, "
             f"first step {compile_s:.1f} s, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    del model, opt, step_fn
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# ---- MNIST CNN ----------------------------------------------------------------------------

def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = struct.unpack(">I", data[:4])[0] & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return torch.frombuffer(bytearray(data[4 + 4 * ndim:]), dtype=torch.uint8).view(dims)


def mnist_data(directory):
    """The training images (normalised as models/data/idx.h), or random ones of the same shape
    when the files are missing (throughput does not depend on the values)."""
    images = os.path.join(directory, "train-images-idx3-ubyte.gz")
    labels = os.path.join(directory, "train-labels-idx1-ubyte.gz")
    if os.path.exists(images) and os.path.exists(labels):
        x = (read_idx(images).float() / 255.0 - 0.2860) / 0.3530
        return x.unsqueeze(1).contiguous(), read_idx(labels).long(), directory
    return torch.randn(60000, 1, 28, 28), torch.randint(0, 10, (60000,)), "random images"


def bench_mnist(a):
    torch.backends.cudnn.allow_tf32 = False  # Tessera's default: TF32 off
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    x, y, source = mnist_data(a.mnist_data)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10)).cuda()
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
    batch = 128
    steps = x.shape[0] // batch
    times = []
    perm = torch.randperm(x.shape[0])
    for step in range(steps):
        t0 = time.perf_counter()
        sel = perm[step * batch:(step + 1) * batch]
        xb, yb = x[sel].cuda(), y[sel].cuda()  # CPU batches copied per step, as Tessera's
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        loss.item()
        if step >= 50:
            times.append(time.perf_counter() - t0)
    sps = len(times) * batch / sum(times)
    row("mnist", "CNN train step (1 epoch, first 50 steps dropped)", f"batch {batch}, {source}",
        "f32", ms=1e3 * statistics.median(times), samples_per_s=sps, note=f"{sps:,.0f} samples/s")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default="", help="only groups whose name contains this")
    p.add_argument("--json", default="")
    p.add_argument("--gpt_batch", type=int, default=8)
    p.add_argument("--gpt_warmup", type=int, default=10)
    p.add_argument("--gpt_steps", type=int, default=40)
    p.add_argument("--no_compile", action="store_true", help="skip the torch.compile GPT-2 run")
    p.add_argument("--gpt_vocab_pad", type=int, default=1,
                   help="GPT-2's embedding rows rounded up to a multiple of this (64: 50304)")
    p.add_argument("--mnist_data", default="/usr/share/datasets/fashion-mnist")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def wanted(group):
        return a.only in group

    def guarded(group, fn, *args):
        if not wanted(group):
            return
        try:
            fn(*args)
        except Exception as e:  # one failing row should not lose the others
            row(group, fn.__name__, "", "", note=f"error: {type(e).__name__}: {str(e)[:150]}")
        torch.cuda.empty_cache()

    ceiling = bench_copy(a)
    guarded("matmul", bench_matmul, a)
    guarded("elementwise", bench_elementwise, a, ceiling)
    guarded("adamw", bench_adamw, a, ceiling)
    guarded("attention", bench_attention, a)
    guarded("gpt2", bench_gpt2, a, False)
    if not a.no_compile:
        guarded("gpt2", bench_gpt2, a, True)
    guarded("mnist", bench_mnist, a)

    name = torch.cuda.get_device_name()
    print(f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) on {name}; op rows: CUDA "
          f"events, median of {a.reps} calls after {a.warmup}; TF32 off unless the dtype says "
          f"tf32. MFU against {H100_BF16_PEAK / 1e12:.0f} TFLOP/s (H100 SXM dense bf16).\n")
    print("| group | op | shape | dtype | ms | TFLOP/s | GB/s | note |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for r in ROWS:
        def num(v, d):
            return f"{v:.{d}f}" if v else ""
        print(f"| {r['group']} | {r['op']} | {r['shape']} | {r['dtype']} | {num(r['ms'], 3)} | "
              f"{num(r['tflops'], 1)} | {num(r['gbps'], 0)} | {r['note']} |")
    if a.json:
        with open(a.json, "a") as f:
            for r in ROWS:
                f.write(json.dumps(dict(r, device=name, torch=torch.__version__)) + "\n")


if __name__ == "__main__":
    main()
