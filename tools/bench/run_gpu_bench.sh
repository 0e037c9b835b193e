#!/bin/bash
# The GPU benchmark, run on the GPU machine from a bundle of prebuilt binaries (no Bazel
# there; tools/gpu_bundle.sh makes the bundle): Tessera's op benchmark (gpu_bench), GPT-2 124M
# training (bf16, vocab 50257, context 1024, batch 8, random tokens), the MNIST CNN on cuda,
# then PyTorch's side (torch_gpu_bench.py), and a side-by-side summary. About 4-6 minutes.
#
#   BUNDLE=/path/to/bundle OUT=/tmp/gpu tools/bench/run_gpu_bench.sh
#
# Bundle layout: $BUNDLE/bin/{gpt,mnist,gpu_bench}, $BUNDLE/lib (extra shared libraries),
# optionally $BUNDLE/data/fashion-mnist. Without Fashion-MNIST files, random images in IDX
# format are written to $TMPDIR and used by both frameworks (throughput only; accuracy is
# meaningless).
# $OUT (a temporary directory if unset) receives nine files: summary.md, run.log, the five
# runs' logs (gpu_bench, tessera_gpt2, tessera_gpt2_unstaged, tessera_mnist, torch) and the
# op rows as JSON lines (tessera_ops.jsonl, torch.jsonl); training metrics and random data
# stay in a scratch dir.
# Knobs: GPT_STEPS (50), GPT_SKIP (10 warm-up steps left out of tokens/s), GPT_BATCH (8),
# MNIST_EPOCHS (2), PYTHON (python3), SKIP_TORCH=1, TORCH_ARGS (e.g. --no_compile),
# STAGE_AB=0 (skip GPT-2's second run, with TESSERA_CUDA_STAGE_UNALIGNED=0: its LM head's
# unaligned 50257-wide products read where they lie instead of through aligned copies; its
# log is tessera_gpt2_unstaged.log).
set -uo pipefail  # not -e: one failing part must not lose the others' results

HERE=$(cd "$(dirname "$0")" && pwd)
BUNDLE=${BUNDLE:-$(cd "$HERE/../.." && pwd)}
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
GPT_STEPS=${GPT_STEPS:-50}
GPT_SKIP=${GPT_SKIP:-10}
GPT_BATCH=${GPT_BATCH:-8}
MNIST_EPOCHS=${MNIST_EPOCHS:-2}
mkdir -p "$OUT"
WORK=$(mktemp -d)
BIN=$BUNDLE/bin

# The bundle's libraries first, then the toolkit's, then the pip wheels' (nvidia/*/lib).
NV_LIBS=$("$PYTHON" - 2>/dev/null <<'PY'
import glob, os, site
dirs = []
for root in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib")))
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="$BUNDLE/lib:/usr/local/cuda/lib64${NV_LIBS:+:$NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

say() { echo "== $*" | tee -a "$OUT/run.log" >&2; }
# run NAME SECONDS CMD...: stdout+stderr to $OUT/NAME.log, a time limit, the status logged.
run() {
  local name=$1 limit=$2
  shift 2
  say "$name: $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc after $((SECONDS - t0)) s (log $OUT/$name.log)"
  tail -n 25 "$OUT/$name.log" >&2
  return $rc
}

say "bundle $BUNDLE, output $OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 |
  tee -a "$OUT/run.log" >&2

# Fashion-MNIST for both frameworks: the bundle's, the system's, or random IDX files.
MNIST_DATA=${MNIST_DATA:-}
for d in "$BUNDLE/data/fashion-mnist" /usr/share/datasets/fashion-mnist; do
  if [ -z "$MNIST_DATA" ] && [ -f "$d/train-images-idx3-ubyte.gz" ]; then MNIST_DATA=$d; fi
done
if [ -z "$MNIST_DATA" ]; then
  MNIST_DATA=$WORK/random-mnist
  say "no Fashion-MNIST files: writing random images to $MNIST_DATA (throughput only)"
  "$PYTHON" - "$MNIST_DATA" <<'PY'
import gzip, os, struct, sys
import numpy as np
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
for prefix, n in (("train", 60000), ("t10k", 10000)):
    with gzip.open(f"{out}/{prefix}-images-idx3-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(struct.pack(">IIII", 0x803, n, 28, 28))
        f.write(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8).tobytes())
    with gzip.open(f"{out}/{prefix}-labels-idx1-ubyte.gz", "wb", compresslevel=1) as f:
        f.write(struct.pack(">II", 0x801, n))
        f.write(rng.integers(0, 10, n, dtype=np.uint8).tobytes())
PY
fi

# 1. Tessera's ops beside the copy ceiling.
rm -f "$OUT/tessera_ops.jsonl" "$OUT/torch.jsonl" "$OUT/tessera_gpt2_unstaged.log"
run gpu_bench 150 "$BIN/gpu_bench" --json="$OUT/tessera_ops.jsonl"

# 2. GPT-2 124M: bf16 autocast with f32 master weights, fused attention, AdamW + clipping;
# no validation while timing (one batch at the end), no sample.
TESSERA_CUDA_STAGE_UNALIGNED=1 run tessera_gpt2 150 "$BIN/gpt" --device=cuda --precision=bf16 \
  --layers=12 --heads=12 --width=768 --context=1024 --vocab=50257 --synthetic_data --batch="$GPT_BATCH" \
  --steps="$GPT_STEPS" --warmup=10 --lr=6e-4 --timing_skip="$GPT_SKIP" --val_every=0 \
  --val_batches=1 --sample=0 --log_every=10 --metrics="$WORK/tessera_gpt.jsonl"

# 2b. The same with the head's unaligned products unstaged (kernels/cuda/matmul.cc): the A/B.
if [ "${STAGE_AB:-1}" != 0 ]; then
  TESSERA_CUDA_STAGE_UNALIGNED=0 run tessera_gpt2_unstaged 150 "$BIN/gpt" --device=cuda \
    --precision=bf16 --layers=12 --heads=12 --width=768 --context=1024 --vocab=50257 \
    --synthetic_data --batch="$GPT_BATCH" --steps="$GPT_STEPS" --warmup=10 --lr=6e-4 \
    --timing_skip="$GPT_SKIP" --val_every=0 --val_batches=1 --sample=0 --log_every=10
fi

# 3. The MNIST CNN on the GPU (f32, TF32 off), two epochs: the last one's samples/s.
run tessera_mnist 90 "$BIN/mnist" --device=cuda --model=cnn --epochs="$MNIST_EPOCHS" \
  --data="$MNIST_DATA" --metrics="$WORK/tessera_mnist.jsonl"

# 4. PyTorch on the same GPU.
if [ "${SKIP_TORCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  run torch 240 "$PYTHON" "$HERE/torch_gpu_bench.py" --json="$OUT/torch.jsonl" \
    --gpt_batch="$GPT_BATCH" --mnist_data="$MNIST_DATA" ${TORCH_ARGS:-}
fi

# 5. Side by side.
"$PYTHON" - "$OUT" "$WORK" "$GPT_BATCH" "$GPT_SKIP" <<'PY' | tee "$OUT/summary.md"
import json, os, re, sys

out, work, batch, skip = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def lines(path):
    return [json.loads(l) for l in open(path)] if os.path.exists(path) else []

def text(name):
    path = os.path.join(out, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""

ours = {(r["group"], r["op"], r["dtype"]): r for r in lines(os.path.join(out, "tessera_ops.jsonl"))}
theirs_rows = lines(os.path.join(out, "torch.jsonl"))
theirs = {(r["group"], r["op"], r["dtype"]): r for r in theirs_rows}
# The same rows under each framework's name.
alias = {"cudaMemcpyAsync D2D": "tensor.copy_ D2D",
         "optim::AdamW::step, 148 tensors": "AdamW(fused=True), 148 tensors",
         "forward, causal": "SDPA forward, causal",
         "forward + backward, causal": "SDPA forward + backward, causal"}
device = next((r["device"] for r in theirs_rows + list(ours.values()) if r.get("device")), "?")
print(f"# GPU benchmark on {device}\n")
print("Tessera (tools/bench/gpu_bench.cc) beside PyTorch (tools/bench/torch_gpu_bench.py); "
      "ratio = Tessera throughput / PyTorch throughput (higher is better for Tessera).\n")
print("| group | op | dtype | Tessera ms | PyTorch ms | Tessera | PyTorch | unit | ratio | Tessera note |")
print("|---|---|---|---:|---:|---:|---:|---|---:|---|")
for key, r in ours.items():
    group, op, dtype = key
    t = theirs.get((group, alias.get(op, op), dtype))
    unit = "TFLOP/s" if r["tflops"] else "GB/s"
    a = r["tflops"] or r["gbps"]
    b = (t["tflops"] or t["gbps"]) if t else 0
    ratio = f"{a / b:.2f}" if a and b else ""
    print(f"| {group} | {op} | {dtype} | {r['ms']:.3f} | {t['ms']:.3f} | {a:,.1f} | {b:,.1f} | "
          f"{unit} | {ratio} | {r['note']} |" if t else
          f"| {group} | {op} | {dtype} | {r['ms']:.3f} | | {a:,.1f} | | {unit} | | {r['note']} |")

# Training: Tessera's final line, PyTorch's rows.
N, L, T, C, peak = 124439808, 12, 1024, 768, 989e12  # GPT-2 124M; H100 SXM dense bf16
flops_per_token = 6 * N + 12 * L * T * C
print("\n| model | framework | tokens/s or samples/s | MFU | note |")
print("|---|---|---:|---:|---|")
for log, label in (("tessera_gpt2.log", "Tessera"),
                   ("tessera_gpt2_unstaged.log", "Tessera, head products unstaged")):
    if log != "tessera_gpt2.log" and not os.path.exists(os.path.join(out, log)):
        continue  # STAGE_AB=0
    m = re.search(r"([0-9.]+) training tokens/s", text(log))
    if m:
        tps = float(m.group(1))
        mem = re.search(r"peak allocated ([0-9.]+) MiB", text(log))
        print(f"| GPT-2 124M bf16, B{batch} T{T} | {label} | {tps:,.0f} | "
              f"{100 * flops_per_token * tps / peak:.1f}% | steps after the first {skip}"
              f"{', peak ' + mem.group(1) + ' MiB' if mem else ''} |")
    else:
        print(f"| GPT-2 124M bf16 | {label} | failed | | see {log} |")
for r in theirs_rows:
    if r["group"] == "gpt2" and "tokens_per_s" in r:
        print(f"| GPT-2 124M bf16, B{batch} T{T} | PyTorch {r['op'].split(', ')[-1]} | "
              f"{r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['note']} |")
epochs = [r["samples_per_s"] for r in lines(os.path.join(work, "tessera_mnist.jsonl"))
          if "samples_per_s" in r and "accuracy" in r]
if epochs:
    print(f"| MNIST CNN f32, batch 128 | Tessera | {epochs[-1]:,.0f} | | last of {len(epochs)} "
          f"epochs (whole epoch incl. per-step batch copy) |")
else:
    print("| MNIST CNN f32 | Tessera | failed | | see tessera_mnist.log |")
for r in theirs_rows:
    if r["group"] == "mnist" and "samples_per_s" in r:
        print(f"| MNIST CNN f32, batch 128 | PyTorch | {r['samples_per_s']:,.0f} | | {r['op']} |")
print(f"\nMFU = (6 N + 12 L T C) x tokens/s / {peak / 1e12:.0f} TFLOP/s, N = {N:,} "
      f"(the tied head counted once). Logs and JSON lines: {out}.")
PY
rm -rf "$WORK"
say "done: $OUT/summary.md"
