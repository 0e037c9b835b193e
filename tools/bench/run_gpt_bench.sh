#!/bin/bash
# Training throughput of the GPT example beside PyTorch: the same byte-level GPT-2, data,
# batch, context, AdamW, clipping and schedule (tools/bench/gpt_torch.py mirrors models/gpt),
# the same thread count, one process at a time, alternating frameworks, ROUNDS rounds of
# STEPS steps each. Tokens/s is taken per window of LOG_EVERY steps; the windows within the
# first SKIP steps are warm-up and dropped. Prints a table of tokens/s (median over every kept
# window of every round, min..max) and the Tessera / PyTorch ratio.
#
#   tools/bench/run_gpt_bench.sh                         # 4 layers, 4 heads, width 128, ctx 128, batch 16
#   STEPS=200 ROUNDS=3 THREADS=2 tools/bench/run_gpt_bench.sh
#
# Waits for a quiet machine before each process (tools/bench/quiet.sh; QUIET_IDLE=0 skips).
# OMP_WAIT_POLICY is passed on as it is in the environment (unset: each runtime's default),
# the same for both frameworks; the table's header says which.
set -euo pipefail

THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-100}
SKIP=${SKIP:-10}
LOG_EVERY=${LOG_EVERY:-10}
LAYERS=${LAYERS:-4}
HEADS=${HEADS:-4}
WIDTH=${WIDTH:-128}
CONTEXT=${CONTEXT:-128}
BATCH=${BATCH:-16}
PYTHON=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch; the PATH python3 may lack torch
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"

cd "$ROOT"
bazel build //models:gpt >&2
# A private copy, so a concurrent build replacing bazel-bin cannot change the binary mid-run.
cp -f bazel-bin/models/gpt/gpt "$OUT/gpt"

model=(--layers="$LAYERS" --heads="$HEADS" --width="$WIDTH" --context="$CONTEXT"
       --batch="$BATCH" --steps="$STEPS" --log_every="$LOG_EVERY" --threads="$THREADS")
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round of $ROUNDS" >&2
  wait_for_quiet
  rm -f "$OUT/tessera_$round.jsonl"
  # No mid-run validation and no sample; the final validation (1 batch) is outside the
  # timed windows.
  "$OUT/gpt" "${model[@]}" --seed="$round" --val_every=0 --val_batches=1 --sample=0 --quiet \
    --metrics="$OUT/tessera_$round.jsonl" >&2
  wait_for_quiet
  "$PYTHON" tools/bench/gpt_torch.py "${model[@]}" --seed="$round" > "$OUT/torch_$round.jsonl"
  cat "$OUT/torch_$round.jsonl" >&2
done

"$PYTHON" - "$OUT" "$SKIP" "$THREADS" "$ROUNDS" "$STEPS" "$LOG_EVERY" \
  "$LAYERS" "$HEADS" "$WIDTH" "$CONTEXT" "$BATCH" <<'PY' | tee "$OUT/table.md"
import glob
import json
import os
import statistics
import sys

out = sys.argv[1]
skip, threads, rounds, steps, log_every, layers, heads, width, context, batch = map(int, sys.argv[2:])
import torch


def windows(pattern):
    values = []
    for path in sorted(glob.glob(f"{out}/{pattern}")):
        for line in open(path):
            rec = json.loads(line)
            if "tokens_per_s" in rec and rec["step"] - log_every >= skip:
                values.append(rec["tokens_per_s"])
    return values


ours, theirs = windows("tessera_*.jsonl"), windows("torch_*.jsonl")
print(f"GPT {layers} layers, {heads} heads, width {width}, context {context}, batch {batch} "
      f"({batch * context} tokens/step), f32, AdamW + clip; {threads} threads (both), "
      f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; {rounds} rounds x {steps} "
      f"steps, first {skip} steps dropped; tokens/s per {log_every}-step window, median over "
      f"{len(ours)} / {len(theirs)} windows (min..max). PyTorch {torch.__version__}. "
      f"ratio = Tessera / PyTorch.")
print()
print("| model | Tessera tokens/s | PyTorch tokens/s | ratio | Tessera min..max | PyTorch min..max |")
print("|---|---:|---:|---:|---:|---:|")
a, b = statistics.median(ours), statistics.median(theirs)
print(f"| gpt L{layers} H{heads} C{width} T{context} B{batch} | {a:,.0f} | {b:,.0f} | {a / b:.2f} | "
      f"{min(ours):,.0f}..{max(ours):,.0f} | {min(theirs):,.0f}..{max(theirs):,.0f} |")
PY
echo "(results in $OUT)" >&2
