#!/bin/bash
# Mixture of Experts on this machine, in one run:
#   1. the FMA peak and Tessera's GEMM (cpu_bench --only gemm), the ceiling;
#   2. moe_bench: grouped_matmul against one GEMM of the same FLOPs and a per-expert loop,
#      forward and forward + backward, on equal and on skewed expert loads;
#   3. GPT training throughput, dense against GPT-MoE of the same active FLOPs (E experts of
#      hidden 4C / K in every MOE_EVERY-th block, top-K: each token runs as many multiply-adds
#      as in the dense MLP), and both in PyTorch (tools/bench/gpt_torch.py: the same model,
#      its MoE as Hugging Face's Mixtral block loops over the experts) with
#      OMP_WAIT_POLICY=passive and with the runtime's default; alternating, ROUNDS rounds of
#      STEPS steps; tokens/s per window of LOG_EVERY steps after the first SKIP steps, median
#      and min..max over every kept window.
#
#   tools/bench/run_moe_bench.sh
#   ROUNDS=3 STEPS=100 E=8 K=2 tools/bench/run_moe_bench.sh
#
# Waits for a quiet machine before each process (tools/bench/quiet.sh; QUIET_IDLE=0 skips).
set -euo pipefail

THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-100}
SKIP=${SKIP:-10}
LOG_EVERY=${LOG_EVERY:-10}
E=${E:-8}
K=${K:-2}
MOE_EVERY=${MOE_EVERY:-2}
WIDTH=${WIDTH:-128}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck source=tools/bench/quiet.sh
source "$ROOT/tools/bench/quiet.sh"
PYTHON=${PYTHON:-/usr/bin/python3}  # Debian's python3-torch

cd "$ROOT"
bazel build //models:gpt //tools/bench:moe_bench //tools/bench:cpu_bench >&2
for b in models/gpt/gpt tools/bench/moe_bench tools/bench/cpu_bench; do cp -f "bazel-bin/$b" "$OUT/"; done

export OMP_WAIT_POLICY=passive  # Tessera's runs and PyTorch's "passive" ones
echo "## machine: $(nproc) cores, $(date -u +%Y-%m-%d)"
wait_for_quiet
"$OUT/cpu_bench" --threads "$THREADS" --only gemm --reps 9 2>&1 | grep -Ei "peak|gemm" | head -8
for skew in 0 1; do
  wait_for_quiet
  "$OUT/moe_bench" --threads "$THREADS" --skew "$skew"
done

if (( (4 * WIDTH) % K != 0 )); then
  echo "run_moe_bench: K=$K does not divide 4 x WIDTH=$((4 * WIDTH)): the experts' hidden width would not give the dense model's FLOPs" >&2
  exit 1
fi
hidden=$((4 * WIDTH / K))
common=(--width="$WIDTH" --steps="$STEPS" --log_every="$LOG_EVERY" --threads="$THREADS"
        --val_every=0 --val_batches=1 --sample=0 --quiet)
moe=(--experts="$E" --moe_top_k="$K" --moe_every="$MOE_EVERY" --moe_hidden="$hidden")
torch_common=(--width="$WIDTH" --steps="$STEPS" --log_every="$LOG_EVERY" --threads="$THREADS")
rm -f "$OUT"/dense_*.jsonl "$OUT"/moe_*.jsonl "$OUT"/torch_*.jsonl  # no earlier run's rounds
for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round of $ROUNDS" >&2
  wait_for_quiet
  "$OUT/gpt" "${common[@]}" --seed="$round" --metrics="$OUT/dense_$round.jsonl" >&2
  wait_for_quiet
  "$OUT/gpt" "${common[@]}" "${moe[@]}" --seed="$round" --metrics="$OUT/moe_$round.jsonl" >&2
  for policy in passive default; do
    for kind in dense moe; do
      wait_for_quiet
      extra=()
      [[ $kind == moe ]] && extra=("${moe[@]}")
      if [[ $policy == passive ]]; then
        OMP_WAIT_POLICY=passive "$PYTHON" tools/bench/gpt_torch.py "${torch_common[@]}" "${extra[@]}" \
          --seed="$round" > "$OUT/torch_${policy}_${kind}_$round.jsonl"
      else
        env -u OMP_WAIT_POLICY "$PYTHON" tools/bench/gpt_torch.py "${torch_common[@]}" "${extra[@]}" \
          --seed="$round" > "$OUT/torch_${policy}_${kind}_$round.jsonl"
      fi
    done
  done
done

/usr/bin/python3 - "$OUT" "$SKIP" "$E" "$K" "$MOE_EVERY" "$hidden" <<'PY'
import glob, json, statistics, sys
out, skip = sys.argv[1], int(sys.argv[2])
def rates(kind):
    r = []
    for path in sorted(glob.glob(f"{out}/{kind}_*.jsonl")):
        for line in open(path):
            rec = json.loads(line)
            if rec.get("tokens_per_s") and rec.get("step", 0) > skip:
                r.append(rec["tokens_per_s"])
    return r
moe_name = f"MoE E={sys.argv[3]} k={sys.argv[4]} every {sys.argv[5]} (hidden {sys.argv[6]})"
table = {}
print("\n| GPT, default model | framework | tokens/s median | min..max | windows |")
print("|---|---|---|---|---|")
for kind, name in (("dense", "dense"), ("moe", moe_name)):
    for fw, prefix in (("Tessera", kind), ("PyTorch, OMP passive", f"torch_passive_{kind}"),
                       ("PyTorch, OMP default", f"torch_default_{kind}")):
        r = rates(prefix)
        table[(kind, fw)] = statistics.median(r)
        print(f"| {name} | {fw} | {statistics.median(r):.0f} | {min(r):.0f}..{max(r):.0f} | {len(r)} |")
for kind in ("dense", "moe"):
    best = max(table[(kind, "PyTorch, OMP passive")], table[(kind, "PyTorch, OMP default")])
    print(f"{kind}: Tessera / best PyTorch = {table[(kind, 'Tessera')] / best:.2f}x")
print(f"MoE / dense: Tessera {table[('moe', 'Tessera')] / table[('dense', 'Tessera')]:.2f}x, "
      f"PyTorch (passive) {table[('moe', 'PyTorch, OMP passive')] / table[('dense', 'PyTorch, OMP passive')]:.2f}x")
PY
