#!/bin/bash
# Gradient compression on a slow link: the default GPT over dp 4, one process per rank under
# mpirun with TCP only (`--mca btl tcp,self`), inside a private network namespace whose
# loopback is capped by tc's token bucket filter. All four ranks share that one capped link
# (a node's uplink, not four private links). For each link rate and each --compress method it
# reports training tokens/s and ms per step (steps after the first SKIP), alternating methods
# within a rate and repeating the whole sweep RUNS times; the table gives the median.
#
#   tools/bench/run_compress_link_bench.sh                    # as root (unshare -n, tc)
#   RATES="none 1gbit 100mbit" STEPS=40 RUNS=2 OUT=/tmp/link tools/bench/run_compress_link_bench.sh
#
# Needs iproute2's tc and ip, util-linux's unshare (tools/setup.sh) and root: unshare -n
# and tc need CAP_SYS_ADMIN and CAP_NET_ADMIN. PowerSGD and 1-bit Adam start compressing after
# START exact steps, so every timed step is compressed (SKIP >= START).
set -euo pipefail

RATES=${RATES:-"none 1gbit 300mbit 100mbit"}
STEPS=${STEPS:-40}
SKIP=${SKIP:-10}
START=${START:-5}
RUNS=${RUNS:-2}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
(( SKIP >= START )) || { echo "SKIP ($SKIP) must be >= START ($START)" >&2; exit 1; }

cd "$ROOT"
bazel build //models/gpt:gpt >&2
# A private copy, so a concurrent build replacing bazel-bin cannot change the binary mid-run.
cp -f bazel-bin/models/gpt/gpt "$OUT/gpt.tmp" && mv -f "$OUT/gpt.tmp" "$OUT/gpt"

methods=(
  "none|"
  "powersgd r4|--compress=powersgd --powersgd_rank=4 --powersgd_start=$START"
  "powersgd r1|--compress=powersgd --powersgd_rank=1 --powersgd_start=$START"
  "onebit_adam|--compress=onebit_adam --onebit_freeze=$START"
)

# One run: RATE METHOD_INDEX RUN -> $OUT/<rate>_<k>_<run>.log
one() {
  local rate=$1 k=$2 run=$3
  local flags=${methods[$k]#*|}
  local log="$OUT/${rate}_${k}_${run}.log"
  # shellcheck disable=SC2086
  unshare -n bash -c "
    set -e
    ip link set lo up
    if [ '$rate' != none ]; then
      # A burst above the loopback MTU (64 KiB), else a full-size packet never leaves.
      tc qdisc add dev lo root tbf rate '$rate' burst 256kb latency 500ms
    fi
    OMP_WAIT_POLICY=passive OMP_NUM_THREADS=1 timeout 900 mpirun --allow-run-as-root \
      --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include lo -np 4 \
      '$OUT/gpt' --dp=4 --steps=$STEPS --timing_skip=$SKIP --val_every=0 --val_batches=1 \
      --sample=0 --log_every=10 $flags" >"$log" 2>&1 || { echo "run failed: $log" >&2; tail -5 "$log" >&2; return 1; }
}

for run in $(seq 1 "$RUNS"); do
  for rate in $RATES; do
    for k in "${!methods[@]}"; do
      one "$rate" "$k" "$run"
      echo "run $run, $rate, ${methods[$k]%%|*}: $(grep -o '[0-9]* training tokens/s' "$OUT/${rate}_${k}_${run}.log")" >&2
    done
  done
done

python3 - "$OUT" "$RUNS" "$RATES" "${#methods[@]}" "$(printf '%s\n' "${methods[@]%%|*}")" <<'PY' | tee "$OUT/table.md"
import re, statistics, sys
out, runs, rates, count, names = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4]), sys.argv[5].split("\n")
def read(rate, k, run):
    text = open(f"{out}/{rate}_{k}_{run}.log").read()
    tps = int(re.search(r"(\d+) training tokens/s", text).group(1))
    tok = int(re.search(r"\((\d+) tokens/step\)", text).group(1))
    fewer = re.findall(r"gradient elements \(([0-9.e+]+)x\)", text)
    return tps, tok, fewer[-1] + "x" if fewer else "1x"
print("| link | --compress | tokens/s (median) | ms/step | vs none | runs (tokens/s) | fewer elements |")
print("|---|---|---:|---:|---:|---|---:|")
for rate in rates:
    base = None
    for k in range(count):
        got = [read(rate, k, r) for r in range(1, runs + 1)]
        med = statistics.median(g[0] for g in got)
        base = med if k == 0 else base
        ms = 1e3 * got[0][1] / med
        print(f"| {rate} | {names[k]} | {med:,.0f} | {ms:,.1f} | {med / base:.2f}x | "
              f"{', '.join(f'{g[0]:,}' for g in got)} | {got[0][2]} |")
PY
