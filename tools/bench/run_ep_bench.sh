#!/bin/bash
# Expert parallelism's memory and traffic per rank, in one run: the GPT example with experts
# in every block on DP data-parallel ranks (threads), with the experts split over groups of
# EP ranks (1: every rank holds all of them) on each ZeRO stage. From each run's own report:
# ZeRO's memory per rank (parameters, gradients, optimizer state, against its formula with
# the experts sharded over their dp / ep holders), the gradient and parameter bytes rank 0
# sends in a step, the peak tensor memory, and tokens/s (2 cores: DP ranks share them, so
# the rate is the program's, not a multi-node figure).
#
#   tools/bench/run_ep_bench.sh
#   DP=8 STEPS=10 tools/bench/run_ep_bench.sh
#
# Waits for a quiet machine before each process (tools/bench/quiet.sh; QUIET_IDLE=0 skips).
set -euo pipefail

DP=${DP:-4}
STEPS=${STEPS:-6}
E=${E:-8}
WIDTH=${WIDTH:-128}
LAYERS=${LAYERS:-4}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"

cd "$ROOT"
bazel build //models:gpt >&2
cp -f bazel-bin/models/gpt/gpt "$OUT/"
export OMP_WAIT_POLICY=passive

echo "GPT $LAYERS layers, width $WIDTH, $E experts of hidden $((4 * WIDTH)) in every block, top-2;" \
     "dp $DP (threads), $STEPS steps, f32 AdamW"
echo
echo "| ep | ZeRO | parameters MiB | gradients MiB (peak) | optimizer MiB | sum / formula | grad+param MiB sent per step | peak MiB | tokens/s |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
ep=1
while [ "$ep" -le "$DP" ]; do
  if [ $((DP % ep)) -eq 0 ] && [ $((E % ep)) -eq 0 ]; then
    for zero in 0 1 2 3; do
      wait_for_quiet
      log="$OUT/ep${ep}_zero${zero}.log"
      "$OUT/gpt" --layers="$LAYERS" --width="$WIDTH" --heads=4 --context=128 --batch=16 \
        --experts="$E" --moe_top_k=2 --moe_every=1 --aux_loss=0.01 --synthetic_data \
        --steps="$STEPS" --warmup=1 --log_every=1 --val_batches=1 --sample=0 --timing_skip=2 \
        --dp="$DP" --ep="$ep" --zero="$zero" > "$log" 2>&1
      mem=$(grep -a "^memory per rank" "$log")
      field() { echo "$mem" | grep -oE "$1 [0-9.]+ MiB" | head -1 | grep -oE "[0-9.]+" | head -1; }
      params=$(field "parameters")
      grads=$(field "gradients")
      gpeak=$(echo "$mem" | grep -oE "\(peak [0-9.]+ MiB\)" | grep -oE "[0-9.]+")
      state=$(field "optimizer state")
      ratio=$(echo "$mem" | grep -oE "\([0-9.]+x;" | grep -oE "[0-9.]+")
      sent=$(grep -a "^communication per step" "$log" | grep -oE "[0-9.]+ MiB" | grep -oE "[0-9.]+")
      peak=$(grep -a "tensor memory: peak" "$log" | grep -oE "peak [0-9.]+ [KMG]iB" | cut -d' ' -f2-)
      rate=$(grep -a "^final val loss" "$log" | grep -oE "[0-9]+ training tokens/s" | grep -oE "^[0-9]+")
      echo "| $ep | $zero | $params | $grads ($gpeak) | $state | ${ratio}x | $sent | $peak | $rate |"
    done
  fi
  ep=$((ep * 2))
done
echo
echo "logs: $OUT"
