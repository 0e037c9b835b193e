#!/bin/bash
# tools/plot_metrics.py turns two small metrics files into a PNG, and rejects bad input with
# the file and line. Needs Debian's /usr/bin/python3 with matplotlib, which tools/setup.sh
# installs (python3-matplotlib): without it the test fails, naming the package to install.
set -euo pipefail

PY=/usr/bin/python3
SCRIPT=tools/plot_metrics.py  # runfiles-relative (data dependency)
if [[ ! -x "$PY" ]]; then
  echo "FAIL: $PY is missing; install Debian's python3-matplotlib (tools/setup.sh does)"
  exit 1
fi
if ! err="$("$PY" -c "import matplotlib" 2>&1)"; then
  echo "FAIL: $PY cannot import matplotlib; install Debian's python3-matplotlib" \
    "(tools/setup.sh does): ${err##*$'\n'}"
  exit 1
fi
[[ -f "$SCRIPT" ]] || { echo "FAIL: $SCRIPT is missing from the runfiles"; exit 1; }

tmp="${TEST_TMPDIR:-$(mktemp -d)}"
export MPLCONFIGDIR="$tmp/mplconfig"  # matplotlib caches fonts there; HOME may be read-only

cat >"$tmp/a.jsonl" <<'JSON'
{"step": 0, "epoch": 0, "loss": 2.30, "lr": 0.001, "samples_per_s": 51000}
{"step": 100, "epoch": 0, "loss": 0.90, "lr": 0.001, "samples_per_s": 60000}

{"step": 200, "epoch": 1, "loss": 0.60, "lr": 0.0005, "val_loss": 0.65, "accuracy": 0.81}
{"step": 300, "epoch": 1, "loss": 0.50, "lr": 0.0005, "samples_per_s": 61000}
{"step": 400, "epoch": 2, "loss": 0.45, "val_loss": 0.52, "accuracy": 0.85}
JSON
cat >"$tmp/b.jsonl" <<'JSON'
{"loss": 2.2}
{"loss": 1.1}
{"loss": 0.7}
JSON

fail() { echo "FAIL: $*"; exit 1; }

check_png() {
  local png="$1"
  [[ -s "$png" ]] || fail "$png is missing or empty"
  local signature
  signature="$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')"
  [[ "$signature" == "89504e470d0a1a0a" ]] ||
    fail "$png does not start with the PNG signature ($signature)"
  # It decodes, and is a real figure rather than a stub.
  local decode='import matplotlib.image, sys
a = matplotlib.image.imread(sys.argv[1])
assert a.shape[0] >= 300 and a.shape[1] >= 500, a.shape'
  "$PY" -c "$decode" "$png" || fail "$png does not decode to a full-size image"
}

out="$("$PY" "$SCRIPT" "$tmp/a.jsonl" "$tmp/b.jsonl" -o "$tmp/plot.png" --title "two runs" --smooth 2)"
echo "$out"
check_png "$tmp/plot.png"
[[ "$out" == *"panels loss, accuracy, throughput; 2 runs, 8 loss points"* ]] || fail "unexpected summary: $out"

# Without accuracy or throughput only the loss panel is drawn; --labels names the runs.
out="$("$PY" "$SCRIPT" "$tmp/b.jsonl" -o "$tmp/loss_only.png" --labels "run B")"
check_png "$tmp/loss_only.png"
[[ "$out" == *"panels loss; 1 runs, 3 loss points"* ]] || fail "unexpected summary: $out"

# Mixture-of-Experts routing (gpt --experts --metrics): an expert-load panel of max/mean
# per block; a malformed "moe" entry is an error naming the file and line.
cat >"$tmp/moe.jsonl" <<'JSON'
{"step": 10, "loss": 3.0, "moe": [{"layer": "h.1", "counts": [40, 20, 10, 10]}, {"layer": "h.3", "counts": [20, 20, 20, 20]}]}
{"step": 20, "loss": 2.5, "moe": [{"layer": "h.1", "counts": [30, 20, 20, 10]}, {"layer": "h.3", "counts": [25, 20, 20, 15]}]}
JSON
out="$("$PY" "$SCRIPT" "$tmp/moe.jsonl" -o "$tmp/moe.png")"
check_png "$tmp/moe.png"
[[ "$out" == *"panels loss, expert load; 1 runs, 2 loss points"* ]] || fail "unexpected summary: $out"
printf '{"step": 1, "loss": 1.0, "moe": [{"layer": "h.0", "counts": "many"}]}\n' >"$tmp/badmoe.jsonl"
if err="$("$PY" "$SCRIPT" "$tmp/badmoe.jsonl" -o "$tmp/x.png" 2>&1)"; then fail "bad moe accepted"; fi
[[ "$err" == *'badmoe.jsonl:1: a "moe" block needs "counts"'* ]] || fail "message: $err"

# Errors: a missing file, a bad line (named by number), a mismatched --labels.
if err="$("$PY" "$SCRIPT" "$tmp/nope.jsonl" -o "$tmp/x.png" 2>&1)"; then fail "missing file accepted"; fi
[[ "$err" == *"cannot read '$tmp/nope.jsonl': No such file or directory"* ]] || fail "message: $err"
printf '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9\n' >"$tmp/bad.jsonl"
if err="$("$PY" "$SCRIPT" "$tmp/bad.jsonl" -o "$tmp/x.png" 2>&1)"; then fail "bad line accepted"; fi
[[ "$err" == *"bad.jsonl:2: invalid JSON"* ]] || fail "message: $err"
printf '{"step": 1, "loss": "high"}\n' >"$tmp/str.jsonl"
if err="$("$PY" "$SCRIPT" "$tmp/str.jsonl" -o "$tmp/x.png" 2>&1)"; then fail "string loss accepted"; fi
[[ "$err" == *'str.jsonl:1: "loss" must be a number'* ]] || fail "message: $err"
if err="$("$PY" "$SCRIPT" "$tmp/a.jsonl" -o "$tmp/x.png" --labels A B 2>&1)"; then fail "labels accepted"; fi
[[ "$err" == *"--labels gives 2 labels for 1 files"* ]] || fail "message: $err"
[[ ! -e "$tmp/x.png" ]] || fail "a failed run wrote $tmp/x.png"

echo "PASS"
