#!/usr/bin/env bash
# The MNIST example under mpirun -np 2 (one process per rank, the MPI communicator) against
# the same run on 2 threads: every step's loss bitwise equal (two ranks reduce in the same
# order on both backends), for ZeRO 2 and for 1-bit Adam (AdamW's exact warm-up, then the
# 1-bit all-reduce) and PowerSGD; then a checkpoint saved under mpirun resumes on threads
# bitwise.
#
#   tests/models/mnist_dp_mpi_test.sh path/to/mnist
set -euo pipefail
bin="$1"
dir="${TEST_TMPDIR:-$(mktemp -d)}"

fashion=/usr/share/datasets/fashion-mnist
[[ -s "$fashion/train-images-idx3-ubyte.gz" || -s "$fashion/train-images-idx3-ubyte" ]] || {
  echo "FAIL: $fashion is missing; install Debian's dataset-fashion-mnist (tools/setup.sh does)"; exit 1; }
command -v mpirun > /dev/null || {
  echo "FAIL: mpirun is missing; install Debian's openmpi-bin (tools/setup.sh does)"; exit 1; }

# OpenMPI inside Bazel's sandbox (as tests/parallel/comm_mpi_test.sh explains).
export HOME="$dir" TMPDIR="$dir"
export OMPI_MCA_plm_rsh_agent= OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl_vader_backing_directory="$dir"
export OMP_WAIT_POLICY=passive

common=(--model=mlp --train_limit=2048 --test_limit=500 --batch=64 --epochs=1 --warmup=5
        --log_every=1 --quiet --threads=1 --dp=2)
mpi() { timeout --kill-after=5 240 mpirun --oversubscribe --allow-run-as-root -np 2 "$bin" "$@"; }
# "step loss" of every per-step line of a metrics file.
losses() { grep '"loss"' "$1" | sed -E 's/.*"loss":([^,}]*).*"step":([0-9]+).*/\2 \1/'; }

cases=0
for extra in "--zero=2" "--compress=onebit_adam --onebit_freeze=5" "--compress=powersgd --powersgd_start=5"; do
  name=$(echo "$extra" | tr -c 'a-z0-9\n' '_')
  # shellcheck disable=SC2086
  "$bin" "${common[@]}" $extra --max_steps=16 --metrics="$dir/$name.threads.jsonl" > /dev/null
  # shellcheck disable=SC2086
  mpi "${common[@]}" $extra --max_steps=16 --metrics="$dir/$name.mpi.jsonl" > /dev/null
  losses "$dir/$name.threads.jsonl" > "$dir/a.txt"
  losses "$dir/$name.mpi.jsonl" > "$dir/b.txt"
  n=$(wc -l < "$dir/a.txt")
  [ "$n" -eq 16 ] || { echo "FAIL ($extra): expected 16 loss lines, got $n"; exit 1; }
  diff "$dir/a.txt" "$dir/b.txt" || { echo "FAIL ($extra): mpirun's losses differ from the threads'"; exit 1; }
  echo "PASS ($extra): 16 losses bitwise equal on mpirun -np 2 and 2 threads"
  cases=$((cases + 1))
done
[ "$cases" -eq 3 ] || { echo "FAIL: $cases cases ran, expected 3"; exit 1; }

# 1-bit Adam saved at step 8 under mpirun (each rank's error feedback gathered into the
# checkpoint), resumed on threads: steps 9-16 as the straight run's.
onebit=(--compress=onebit_adam --onebit_freeze=5)
mpi "${common[@]}" "${onebit[@]}" --max_steps=8 --save="$dir/ck.safetensors" > /dev/null
"$bin" "${common[@]}" "${onebit[@]}" --max_steps=16 --resume="$dir/ck.safetensors" \
  --metrics="$dir/resumed.jsonl" > /dev/null
losses "$dir/resumed.jsonl" > "$dir/b.txt"
losses "$dir/__compress_onebit_adam___onebit_freeze_5.threads.jsonl" | tail -n 8 > "$dir/a.txt"
[ "$(wc -l < "$dir/b.txt")" -eq 8 ] || { echo "FAIL: the resumed run logged $(wc -l < "$dir/b.txt") losses, expected 8"; exit 1; }
diff "$dir/a.txt" "$dir/b.txt" || { echo "FAIL: resumed on threads from mpirun's checkpoint, the losses differ"; exit 1; }
echo "PASS: saved under mpirun at step 8, resumed on 2 threads: steps 9-16 bitwise the straight run's"
