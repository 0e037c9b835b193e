#!/bin/bash
# Training throughput of the GPT example beside PyTorch: the same byte-level GPT-2, data,
# batch, context, AdamW, clipping and schedule (tools/bench/gpt_torch.py mirrors models/gpt),
# the same thread count, one process at a time, alternating frameworks, ROUNDS rounds of
# STEPS steps each. Tokens/s is taken per window of LOG_EVERY steps; the windows within the
# first SKIP steps are warm-up and dropped. Prints a table of tokens/s (median over every kept
# window of every round, min..max) and the ratio of each framework's better setting.
#
#   tools/bench/run_gpt_bench.sh                         # 4 layers, 4 heads, width 128, ctx 128, batch 16
#   STEPS=200 ROUNDS=3 THREADS=2 tools/bench/run_gpt_bench.sh
#   PRECISION=bf16 tools/bench/run_gpt_bench.sh          # gpt --precision=bf16 beside torch.autocast
#
# Waits for a quiet machine before each process (tools/bench/quiet.sh; QUIET_IDLE=0 skips).
# CONTEND=1: measures under contention instead - after one wait for a quiet machine, a
# CPU-bound busy loop pinned to core 0 runs for the whole measurement (as another user's
# job sharing the node would), and no further waits are made.
# Each framework runs with OMP_WAIT_POLICY=passive and with the runtime's default (unset):
# PyTorch's OpenMP and OpenBLAS pools fight when they spin, so its two settings differ up to
# 3x on a small machine; the ratio is claimed between the better of each.
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
PRECISION=${PRECISION:-f32}
case "$PRECISION" in
  f32|bf16) ;;
  *) echo "run_gpt_bench.sh: PRECISION=$PRECISION: f32 or bf16 (gpt_torch.py has no f16 loss scaling)" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch; the PATH python3 may lack torch
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"

CONTEND=${CONTEND:-0}

cd "$ROOT"
bazel build //models:gpt >&2
# A private copy, so a concurrent build replacing bazel-bin cannot change the binary mid-run.
cp -f bazel-bin/models/gpt/gpt "$OUT/gpt"

if [ "$CONTEND" = 1 ]; then
  wait_for_quiet
  taskset -c 0 sh -c 'while :; do :; done' &
  busy=$!
  trap 'kill "$busy" 2>/dev/null' EXIT
  QUIET_IDLE=0
  echo "[contention: busy loop pid $busy pinned to core 0]" >&2
fi

model=(--layers="$LAYERS" --heads="$HEADS" --width="$WIDTH" --context="$CONTEXT"
       --batch="$BATCH" --steps="$STEPS" --log_every="$LOG_EVERY" --threads="$THREADS"
       --precision="$PRECISION")
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round of $ROUNDS" >&2
  for policy in passive default; do
    run_env=(env -u OMP_WAIT_POLICY)
    [ "$policy" = passive ] && run_env=(env OMP_WAIT_POLICY=passive)
    wait_for_quiet
    rm -f "$OUT/tessera_${policy}_$round.jsonl"
    # No mid-run validation and no sample; the final validation (1 batch) is outside the
    # timed windows.
    "${run_env[@]}" "$OUT/gpt" "${model[@]}" --seed="$round" --val_every=0 --val_batches=1 \
      --sample=0 --quiet --metrics="$OUT/tessera_${policy}_$round.jsonl" >&2
    wait_for_quiet
    "${run_env[@]}" "$PYTHON" tools/bench/gpt_torch.py "${model[@]}" --seed="$round" \
      > "$OUT/torch_${policy}_$round.jsonl"
    cat "$OUT/torch_${policy}_$round.jsonl" >&2
  done
done

"$PYTHON" - "$OUT" "$SKIP" "$THREADS" "$ROUNDS" "$STEPS" "$LOG_EVERY" \
  "$LAYERS" "$HEADS" "$WIDTH" "$CONTEXT" "$BATCH" "$CONTEND" "$PRECISION" <<'PY' | tee "$OUT/table.md"
import glob
import json
import statistics
import sys

out = sys.argv[1]
skip, threads, rounds, steps, log_every, layers, heads, width, context, batch, contend = map(int, sys.argv[2:13])
precision = sys.argv[13]
import torch


def windows(pattern):
    values = []
    for path in sorted(glob.glob(f"{out}/{pattern}")):
        for line in open(path):
            rec = json.loads(line)
            if "tokens_per_s" in rec and rec["step"] - log_every >= skip:
                values.append(rec["tokens_per_s"])
    return values


print(f"GPT {layers} layers, {heads} heads, width {width}, context {context}, batch {batch} "
      f"({batch * context} tokens/step), "
      + ("f32" if precision == "f32" else "bf16 autocast (f32 weights and optimizer)")
      + f", AdamW + clip; {threads} threads (both); {rounds} "
      f"rounds x {steps} steps per setting, first {skip} steps dropped; tokens/s per "
      f"{log_every}-step window, median over every kept window (min..max). PyTorch "
      f"{torch.__version__}."
      + (" Under contention: a busy loop pinned to core 0 ran throughout." if contend else ""))
print()
print("| framework | OMP_WAIT_POLICY | tokens/s median | min..max | windows |")
print("|---|---|---:|---:|---:|")
best = {}
for name, prefix in (("Tessera", "tessera"), ("PyTorch", "torch")):
    for policy in ("passive", "default"):
        w = windows(f"{prefix}_{policy}_*.jsonl")
        m = statistics.median(w)
        best[name] = max(best.get(name, 0.0), m)
        print(f"| {name} | {policy} | {m:,.0f} | {min(w):,.0f}..{max(w):,.0f} | {len(w)} |")
print()
print(f"Tessera / PyTorch, each at its better setting: {best['Tessera'] / best['PyTorch']:.2f}x")
PY
echo "(results in $OUT)" >&2
