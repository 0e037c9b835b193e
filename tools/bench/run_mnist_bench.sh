#!/bin/bash
# Training throughput of the MNIST example beside PyTorch: the same MLP and CNN, batch,
# AdamW, schedule and data (tools/bench/mnist_torch.py mirrors models/mnist), the same thread
# count, one process at a time, alternating frameworks, RUNS runs of EPOCHS epochs each.
# Prints a table of samples/s per epoch (median over every epoch of every run, min..max).
#
#   tools/bench/run_mnist_bench.sh                      # mlp and cnn, 2 threads, 3 runs x 2 epochs
#   MODELS=mlp RUNS=5 EPOCHS=3 tools/bench/run_mnist_bench.sh
#
# Waits for a quiet machine before each process (tools/bench/quiet.sh; QUIET_IDLE=0 skips).
set -euo pipefail

THREADS=${THREADS:-2}
RUNS=${RUNS:-3}
EPOCHS=${EPOCHS:-2}
BATCH=${BATCH:-128}
MODELS=${MODELS:-mlp cnn}
PYTHON=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch; the PATH python3 may lack torch
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"

cd "$ROOT"
bazel build //models/mnist:mnist >&2
cp -f bazel-bin/models/mnist/mnist "$OUT/mnist"

for model in $MODELS; do
  for run in $(seq 1 "$RUNS"); do
    echo "== $model run $run of $RUNS" >&2
    wait_for_quiet
    "$OUT/mnist" --model="$model" --epochs="$EPOCHS" --batch="$BATCH" --threads="$THREADS" \
      --seed="$run" --metrics="$OUT/tessera_${model}_$run.jsonl" >&2
    wait_for_quiet
    "$PYTHON" tools/bench/mnist_torch.py --model="$model" --epochs="$EPOCHS" --batch="$BATCH" \
      --threads="$THREADS" --seed="$run" > "$OUT/torch_${model}_$run.jsonl"
    cat "$OUT/torch_${model}_$run.jsonl" >&2
  done
done

"$PYTHON" - "$OUT" "$RUNS" "$EPOCHS" "$BATCH" "$THREADS" $MODELS <<'PY' | tee "$OUT/table.md"
import glob
import json
import statistics
import sys

out, runs, epochs, batch, threads, models = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                             sys.argv[4], sys.argv[5], sys.argv[6:])
import torch
print(f"Batch {batch}, AdamW, {threads} threads (both), {runs} runs x {epochs} epochs; samples/s "
      f"per training epoch (evaluation excluded), median over all epochs (min..max). PyTorch "
      f"{torch.__version__}. ratio = Tessera / PyTorch.")
print()
print("| model | Tessera samples/s | PyTorch samples/s | ratio | Tessera min..max | PyTorch min..max | final test accuracy Tessera / PyTorch |")
print("|---|---:|---:|---:|---:|---:|---:|")
for model in models:
    ours, acc_ours, theirs, acc_theirs = [], [], [], []
    for path in sorted(glob.glob(f"{out}/tessera_{model}_*.jsonl")):
        lines = [json.loads(l) for l in open(path)]
        epochs_lines = [l for l in lines if "accuracy" in l]
        ours += [l["samples_per_s"] for l in epochs_lines]
        acc_ours.append(epochs_lines[-1]["accuracy"])
    for path in sorted(glob.glob(f"{out}/torch_{model}_*.jsonl")):
        lines = [json.loads(l) for l in open(path)]
        theirs += [l["samples_per_s"] for l in lines]
        acc_theirs.append(lines[-1]["accuracy"])
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"| {model} | {a:,.0f} | {b:,.0f} | {a / b:.2f} | {min(ours):,.0f}..{max(ours):,.0f} | "
          f"{min(theirs):,.0f}..{max(theirs):,.0f} | "
          f"{100 * statistics.mean(acc_ours):.2f}% / {100 * statistics.mean(acc_theirs):.2f}% |")
PY
echo "(results in $OUT)" >&2
