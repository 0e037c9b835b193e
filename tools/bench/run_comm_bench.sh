#!/bin/bash
# Builds //tools/bench:comm_bench and runs every configuration, one process at a time, each
# after the machine is quiet (tools/bench/quiet.sh): the memcpy ceiling, the threads backend
# with 2 and 4 ranks, and the MPI backend with 2 processes beside raw MPI calls. Prints the
# markdown tables (also written to $OUT/table.md).
#
#   tools/bench/run_comm_bench.sh                        # 1 KiB .. 256 MiB, x4 steps
#   REPS=15 MAX_BYTES=$((64 << 20)) OUT=/tmp/comm tools/bench/run_comm_bench.sh
#   QUIET_IDLE=0 tools/bench/run_comm_bench.sh           # no waiting for an idle machine
set -euo pipefail

REPS=${REPS:-9}
WARMUP=${WARMUP:-2}
MIN_MS=${MIN_MS:-10}
MIN_BYTES=${MIN_BYTES:-1024}
MAX_BYTES=${MAX_BYTES:-268435456}
STEP=${STEP:-4}
MPI_RANKS=${MPI_RANKS:-2}
THREAD_RANKS=${THREAD_RANKS:-"2 4"}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"

cd "$ROOT"
bazel build //tools/bench:comm_bench >&2
# A private copy, so a concurrent build replacing bazel-bin cannot change the binary mid-run.
cp -f bazel-bin/tools/bench/comm_bench "$OUT/comm_bench"

# Idle OpenMP workers sleep: the ranks (threads or processes) need every core.
export OMP_WAIT_POLICY=passive
sizes=(--min_bytes "$MIN_BYTES" --max_bytes "$MAX_BYTES" --step "$STEP")
timing=(--reps "$REPS" --warmup "$WARMUP" --min_ms "$MIN_MS")

{
  echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u +%F)."
  wait_for_quiet
  "$OUT/comm_bench" --backend memcpy --max_bytes "$MAX_BYTES" --reps "$REPS" --warmup "$WARMUP"
  for n in $THREAD_RANKS; do
    wait_for_quiet
    "$OUT/comm_bench" --backend threads --ranks "$n" "${sizes[@]}" "${timing[@]}"
  done
  wait_for_quiet
  # Shared memory between the processes; --oversubscribe lets MPI_RANKS exceed the cores.
  OMPI_MCA_btl=self,vader mpirun --oversubscribe --allow-run-as-root -np "$MPI_RANKS" \
    "$OUT/comm_bench" --backend mpi "${sizes[@]}" "${timing[@]}"
} | tee "$OUT/table.md"
echo "(results in $OUT)" >&2
