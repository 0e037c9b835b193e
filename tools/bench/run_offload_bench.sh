#!/usr/bin/env bash
# Offload's headline (BENCHMARKS.md "CPU: training past the device budget"): a GPT of 12
# layers of width 768 (85.3M parameters: 1.36 GB of f32 AdamW model states) under a device
# budget of 300 MB with the parameters and the optimizer state in a swap file, beside the
# same run in memory, with in the same run:
#   - fio's ceiling on the swap directory (O_DIRECT, the swap file's block size and two jobs,
#     as its I/O threads): reads, writes, and the step's mix of the two;
#   - the CPU AdamW update's GB/s against a STREAM triad (tools/bench/optim_bench).
# The offloaded run goes once per --offload_window in WINDOWS (MiB of host memory for pages
# read ahead and written behind): each row gives its step time, the swap file's traffic and
# busy time, the host tier's peak, and the overlap ratio step / max(in-memory step, swap busy).
# Rounds alternate the runs (this machine is shared and noisy); figures are medians over
# the steps after the first two of every round.
#
#   tools/bench/run_offload_bench.sh                  # ROUNDS=2 STEPS=8 BATCH=2 WINDOWS="0 512 768"
#   OFFLOAD_DIR=/nvme/scratch tools/bench/run_offload_bench.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-8}
BATCH=${BATCH:-2}
BUDGET=${BUDGET:-300M}
WINDOWS=${WINDOWS:-0 512 768}
DIR=${OFFLOAD_DIR:-$PWD/.offload_scratch}
OUT=${OUT:-/tmp/offload_bench}
mkdir -p "$DIR" "$OUT"
command -v fio > /dev/null || { echo "run_offload_bench: fio is missing (tools/setup.sh installs it)" >&2; exit 1; }

bazel build -c opt //models/gpt:gpt //tools/bench:optim_bench > /dev/null
cp -f bazel-bin/models/gpt/gpt "$OUT/gpt"
cp -f bazel-bin/tools/bench/optim_bench "$OUT/optim_bench"

echo "== $(date -u +%F' '%H:%M) UTC, $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
echo "== swap directory $DIR: $(df -hT "$DIR" | awk 'NR == 2 { print $2 " on " $1 }')"

fio_mb() {  # rw mode, extra args: MB/s (reads + writes) with the swap file's I/O shape
  local mode=$1
  shift
  fio --name=ceiling --filename="$DIR/fio.dat" --size=2G --bs=4M --direct=1 --ioengine=psync \
      --numjobs=2 --group_reporting --rw="$mode" "$@" --output-format=json 2> /dev/null |
    python3 -c 'import json, sys
j = json.load(sys.stdin)["jobs"][0]
print("%.0f" % ((j["read"]["io_bytes"] + j["write"]["io_bytes"]) / 1e6 /
                 (max(j["read"]["runtime"], j["write"]["runtime"]) / 1e3)))'
}

COMMON=(--synthetic_data --steps="$STEPS" --zero=3 --layers=12 --width=768 --heads=12
        --context=64 --batch="$BATCH" --log_every=1 --quiet)
OFF=(--offload_optimizer=nvme --offload_params=nvme --offload_dir="$DIR" --memory_limit="$BUDGET")
for r in $(seq 1 "$ROUNDS"); do
  fio_mb write > "$OUT/fio_write.$r"
  fio_mb read > "$OUT/fio_read.$r"
  fio_mb rw --rwmixread=57 > "$OUT/fio_mix.$r"
  rm -f "$DIR/fio.dat"
  "$OUT/optim_bench" --numel 67108864 --threads 2 --rounds 3 --reps 5 > "$OUT/optim.$r"
  rm -f "$OUT"/mem.$r.jsonl "$OUT"/host.$r.jsonl "$OUT"/off*.$r.jsonl
  "$OUT/gpt" "${COMMON[@]}" --metrics="$OUT/mem.$r.jsonl"
  "$OUT/gpt" "${COMMON[@]}" --offload_optimizer=host --offload_params=host --memory_limit="$BUDGET" \
    --metrics="$OUT/host.$r.jsonl"
  for w in $WINDOWS; do
    "$OUT/gpt" "${COMMON[@]}" "${OFF[@]}" --offload_window="$w" --metrics="$OUT/off$w.$r.jsonl"
  done
done

python3 - "$OUT" "$ROUNDS" "$BATCH" $WINDOWS <<'PY'
import json, statistics, sys
out, rounds, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
windows = sys.argv[4:]
tokens = batch * 64

def steps(kind):
    rows, val = [], []
    for r in range(1, rounds + 1):
        recs = [json.loads(l) for l in open(f"{out}/{kind}.{r}.jsonl") if l.strip()]
        train = [x for x in recs if "tokens_per_s" in x]
        rows += train[2:]  # the first two steps warm up
        val += [x["val_loss"] for x in recs if "val_loss" in x]
    return rows, val

def med(xs): return statistics.median(xs)
def nums(name): return [float(open(f"{out}/{name}.{r}").read()) for r in range(1, rounds + 1)]

mem, mem_val = steps("mem")
mem_ms = med([tokens / x["tokens_per_s"] * 1e3 for x in mem])
print(f"in memory:          {mem_ms:7.0f} ms/step, val loss {mem_val}")
host_rows, host_val = steps("host")
print(f"host tier:          {med([tokens / x['tokens_per_s'] * 1e3 for x in host_rows]):7.0f} ms/step, "
      f"host tier peak {max(x['offload_host_peak_bytes'] for x in host_rows) / 2**20:.0f} MiB "
      f"(everything in host memory), same losses as in memory: {host_val == mem_val}")
for w in windows:
    name = f"window {w} MiB"
    rows, val = steps(f"off{w}")
    host = max(x["offload_host_peak_bytes"] for x in rows) / 2**20
    ms = med([tokens / x["tokens_per_s"] * 1e3 for x in rows])
    io = med([x["offload_io_seconds"] for x in rows]) * 1e3
    rd = med([x["offload_read_bytes"] for x in rows])
    wr = med([x["offload_written_bytes"] for x in rows])
    mbs = med([(x["offload_read_bytes"] + x["offload_written_bytes"]) / x["offload_io_seconds"] / 1e6 for x in rows])
    print(f"{name + ':':19s} {ms:7.0f} ms/step, val loss {val}; swap {rd / 2**20:.1f} MiB read + "
          f"{wr / 2**20:.1f} MiB written per step, busy {io:.0f} ms = {mbs:.0f} MB/s; "
          f"step / max(in-memory step, swap busy) = {ms / max(mem_ms, io):.2f}; "
          f"{ms / mem_ms:.2f}x the in-memory step; host tier peak {host:.0f} MiB")
    print(f"{'':19s} same losses as in memory: {val == mem_val}")
print(f"fio (O_DIRECT, 4 MiB, 2 jobs): write {med(nums('fio_write')):.0f} MB/s, read "
      f"{med(nums('fio_read')):.0f} MB/s, 57% reads (the step's mix) {med(nums('fio_mix')):.0f} MB/s")
for r in range(1, rounds + 1):
    print(f"optim_bench round {r}:", *[l.rstrip() for l in open(f"{out}/optim.{r}")
                                        if l.startswith(("adamw_ ", "triad", "copy", "adamw_ at"))], sep="\n  ")
PY
