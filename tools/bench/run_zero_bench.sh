#!/bin/bash
# Memory and communication per rank of the GPT example under ZeRO stages 0-3 on DP simulated
# ranks (threads backend): rank 0's tagged bytes after the first step against the ZeRO
# formula, the bytes it sent in one step, and the training tokens/s of the whole run.
#
#   tools/bench/run_zero_bench.sh                  # dp 2 and 4, the default model, 20 steps
#   DPS="2 4 8" STEPS=40 tools/bench/run_zero_bench.sh
#   GPT_ARGS="--layers=12 --heads=12 --width=768 --batch=8" DPS=4 STEPS=3 tools/bench/run_zero_bench.sh
#
# On a 2-core machine the ranks share the cores, so tokens/s shows the overhead of the
# wrappers (and, for stage 3, of gathering per unit), not a speed-up.
set -euo pipefail

DPS=${DPS:-2 4}
STEPS=${STEPS:-20}
GPT_ARGS=${GPT_ARGS:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
cd "$ROOT"
bazel build //models:gpt >&2
cp -f bazel-bin/models/gpt/gpt "$OUT/gpt"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

echo "| dp | stage | parameters | gradients | gradients peak | optimizer state | sum | formula | sum / formula | stage 3 gathered peak | sent per step | in 4Ψ(n-1)/n | tokens/s |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for dp in $DPS; do
  for zero in 0 1 2 3; do
    log="$OUT/dp${dp}_zero${zero}.log"
    # shellcheck disable=SC2086
    "$OUT/gpt" $GPT_ARGS --dp="$dp" --zero="$zero" --steps="$STEPS" --log_every="$STEPS" --val_every=0 \
      --val_batches=1 --sample=0 > "$log" 2>&1
    /usr/bin/python3 - "$log" "$dp" "$zero" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
dp, zero = sys.argv[2], sys.argv[3]
mem = re.search(r"parameters ([\d.]+) MiB, gradients ([\d.]+) MiB \(peak ([\d.]+) MiB\), "
                r"optimizer state ([\d.]+) MiB; sum ([\d.]+) MiB vs formula ([\d.]+) MiB "
                r"\(([\d.]+)x\)", text)
peak = re.search(r"gathered peak ([\d.]+) MiB", text)
comm = re.search(r"([\d.]+) MiB of gradients and parameters = ([\d.]+) x", text)
tps = re.search(r"; (\d+) training tokens/s", text)
print(f"| {dp} | {zero} | {mem[1]} MiB | {mem[2]} MiB | {mem[3]} MiB | {mem[4]} MiB | {mem[5]} MiB "
      f"| {mem[6]} MiB | {mem[7]} | {peak[1] + ' MiB' if peak else '-'} | {comm[1]} MiB | {comm[2]} | {tps[1]} |")
PY
  done
done
echo "(logs in $OUT)"
