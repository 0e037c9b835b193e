#!/usr/bin/env bash
# Exact resume across processes: `mnist --max_steps=2N` in one process, and `--max_steps=N
# --save` then `--resume --max_steps=2N` in two more, log every step's loss; the last N
# losses must be bitwise equal (compared as the exact decimal text JSON prints for a double).
# Then PyTorch reads the checkpoint and matplotlib plots the metrics.
#
# Needs what tools/setup.sh installs: Fashion-MNIST (dataset-fashion-mnist) and Debian's
# /usr/bin/python3 with torch (python3-torch) and matplotlib (python3-matplotlib). A missing
# one fails the test, naming the package, before anything runs.
set -euo pipefail
bin="$1"
check="$2"   # tools/safetensors_check.py
plot="$3"    # tools/plot_metrics.py
dir="${TEST_TMPDIR:-$(mktemp -d)}"

# missing WHAT PACKAGE [DETAIL]: fails naming the Debian package that provides WHAT.
missing() {
  echo "FAIL: $1 is missing; install Debian's $2 (tools/setup.sh does)${3:+: $3}"
  exit 1
}
fashion=/usr/share/datasets/fashion-mnist
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  [[ -s "$fashion/$f.gz" || -s "$fashion/$f" ]] || missing "$fashion/$f.gz" dataset-fashion-mnist
done
[[ -x /usr/bin/python3 ]] || missing /usr/bin/python3 "python3-torch and python3-matplotlib"
for module in torch:python3-torch matplotlib:python3-matplotlib; do
  if ! err="$(/usr/bin/python3 -c "import ${module%%:*}" 2>&1)"; then
    missing "/usr/bin/python3's ${module%%:*} module" "${module#*:}" "${err##*$'\n'}"
  fi
done

common=(--model=mlp --train_limit=4096 --test_limit=500 --batch=64 --epochs=2 --log_every=1 --quiet --threads=2)

"$bin" "${common[@]}" --max_steps=100 --metrics="$dir/straight.jsonl"
"$bin" "${common[@]}" --max_steps=50 --save="$dir/ckpt.safetensors" --metrics="$dir/resumed.jsonl"
test -s "$dir/ckpt.safetensors" && test -s "$dir/ckpt.state.safetensors"
"$bin" "${common[@]}" --max_steps=100 --resume="$dir/ckpt.safetensors" --metrics="$dir/resumed.jsonl"

# "step":S and "loss":L of every per-step line (epoch lines carry no "loss").
losses() { grep '"loss"' "$1" | sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/'; }
losses "$dir/straight.jsonl" > "$dir/a.txt"
losses "$dir/resumed.jsonl" > "$dir/b.txt"
n_a=$(wc -l < "$dir/a.txt")
n_b=$(wc -l < "$dir/b.txt")
if [ "$n_a" -ne 100 ] || [ "$n_b" -ne 100 ]; then
  echo "FAIL: expected 100 loss lines in each run, got $n_a and $n_b"; exit 1
fi
if ! diff "$dir/a.txt" "$dir/b.txt"; then
  echo "FAIL: the resumed run's losses differ from the straight run's"; exit 1
fi
echo "PASS: 100 steps, losses of steps 51-100 bitwise equal after a restart at step 50"
tail -n 2 "$dir/b.txt"

# The checkpoint is a plain state dict that an independent reader (struct + json + torch)
# accepts, with torch.nn's names for the MLP's two Linear layers.
/usr/bin/python3 "$check" "$dir/ckpt.safetensors" > "$dir/names.txt"
for name in 1.weight 1.bias 3.weight 3.bias; do
  grep -qP "^$name\t" "$dir/names.txt" || { echo "FAIL: $name missing"; cat "$dir/names.txt"; exit 1; }
done
MPLCONFIGDIR="$dir" /usr/bin/python3 "$plot" "$dir/straight.jsonl" "$dir/resumed.jsonl" -o "$dir/plot.png"
test -s "$dir/plot.png" || { echo "FAIL: no plot"; exit 1; }
echo "PASS: checkpoint read by tools/safetensors_check.py; metrics plotted"
