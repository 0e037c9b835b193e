#!/bin/bash
# Builds //tools/bench:cpu_bench, runs it and tools/bench/torch_peer.py (Debian's PyTorch) with
# the same thread count, one process at a time, alternating, RUNS times each, and prints a
# side-by-side table of the median over runs of each run's median over REPS repetitions.
#
#   tools/bench/run_cpu_bench.sh                 # 2 threads, 3 runs x 21 reps, quiet machine
#   THREADS=1 RUNS=5 tools/bench/run_cpu_bench.sh
#   OUT=/tmp/bench tools/bench/run_cpu_bench.sh  # keeps the JSON of every run and table.md
#
# Before each benchmark process the script waits (up to QUIET_TIMEOUT seconds) until the CPUs
# were at least QUIET_IDLE percent idle over 2 s and the 1-minute load average is below
# QUIET_LOAD, because other jobs on a small machine skew every figure (the load average also
# has to decay from the previous benchmark, so each process may wait a minute or two). Set
# QUIET_IDLE=0 to skip the wait. Alternating the two frameworks spreads slow phases of the
# machine over both; the min..max columns show how much the runs disagreed.
set -euo pipefail

THREADS=${THREADS:-2}
RUNS=${RUNS:-3}
REPS=${REPS:-21}
WARMUP=${WARMUP:-3}
PYTHON=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch; the PATH python3 may lack torch
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"

cd "$ROOT"
bazel build //tools/bench:cpu_bench >&2
# A private copy, so a concurrent build replacing bazel-bin cannot change the binary mid-run.
cp -f bazel-bin/tools/bench/cpu_bench "$OUT/cpu_bench"

for run in $(seq 1 "$RUNS"); do
  echo "== run $run of $RUNS" >&2
  wait_for_quiet
  "$OUT/cpu_bench" --threads "$THREADS" --reps "$REPS" --warmup "$WARMUP" \
    --json "$OUT/tessera_$run.json" >&2
  wait_for_quiet
  "$PYTHON" tools/bench/torch_peer.py --threads "$THREADS" --reps "$REPS" --warmup "$WARMUP" \
    --json "$OUT/torch_$run.json" >&2
done

"$PYTHON" - "$OUT" "$RUNS" "$REPS" <<'EOF' | tee "$OUT/table.md"
import json
import statistics
import sys

out, runs, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tessera = [json.load(open(f"{out}/tessera_{r}.json")) for r in range(1, runs + 1)]
torch = [json.load(open(f"{out}/torch_{r}.json")) for r in range(1, runs + 1)]


def values(reports):
    by_name = {}
    for report in reports:
        for r in report["results"]:
            by_name.setdefault(r["name"], []).append(r["value"])
    return by_name


ours, theirs = values(tessera), values(torch)
print(f"Threads: {tessera[0]['threads']} (both). Tessera GEMM kernel: {tessera[0]['gemm_kernel']}."
      f" PyTorch {torch[0]['version']} ({torch[0]['blas']}). Each figure: median over {runs} "
      f"runs of the median of {reps} repetitions. Higher is better; ratio = Tessera / PyTorch.")
print()
print("| operation | unit | Tessera | PyTorch | ratio | Tessera min..max | PyTorch min..max |")
print("|---|---|---:|---:|---:|---:|---:|")
for r in tessera[0]["results"]:
    name, unit = r["name"], r["unit"]
    mine = ours[name]
    peer = theirs.get(name)
    mid = statistics.median(mine)
    peer_mid = statistics.median(peer) if peer else None
    print(f"| {name} | {unit} | {mid:.1f} | "
          f"{f'{peer_mid:.1f}' if peer else 'n/a'} | "
          f"{f'{mid / peer_mid:.2f}' if peer else 'n/a'} | "
          f"{min(mine):.1f}..{max(mine):.1f} | "
          f"{f'{min(peer):.1f}..{max(peer):.1f}' if peer else 'n/a'} |")
EOF
echo "(results in $OUT)" >&2
