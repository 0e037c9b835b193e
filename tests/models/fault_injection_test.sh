#!/usr/bin/env bash
# Fault injection on whole processes (docs/RELIABILITY.md): what a demanding user does to a
# training run, and what Tessera must survive.
#   1. kill -9 at every step of a checkpoint save (TESSERA_FAULT, deterministic), on one
#      rank and on --dp=2 --zero=3: the last complete checkpoint always loads and the resumed
#      run ends bit for bit where an uninterrupted run ends (weights and optimizer state).
#   2. kill -9 at random moments of a run that saves every step (one rank and --dp=2
#      --zero=3): the same promise.
#   3. SIGTERM (a real one, from outside, and one injected on --dp=2 --zero=3): the step is
#      finished, a checkpoint written, exit code 143, and the resumed run ends bit for bit.
#   4. mpirun -np 2: an error on one rank (a bad --save path, an error mid-run) ends the whole
#      job within a bounded time with the message; a rank stopped with SIGSTOP is reported
#      by the watchdog (--comm_timeout) and the job ends.
#
#   5. mnist: an injected SIGTERM saves and exits 143; the resumed run ends bit for bit.
#
#   tests/models/fault_injection_test.sh GPT_BINARY SAME_TENSORS_PY MNIST_BINARY [RANDOM_KILLS]
set -uo pipefail

gpt=$1
same=$2
mnist=$3
random_kills=${4:-30}
dir="${TEST_TMPDIR:-$(mktemp -d)}/faults"
rm -rf "$dir"
mkdir -p "$dir"
export OMP_WAIT_POLICY=passive

failures=0
checks=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { checks=$((checks + 1)); }

common=(--layers=1 --width=32 --heads=2 --context=16 --batch=8 --steps=12 --sample=0
        --val_every=0 --val_batches=1 --threads=1 --quiet)
layouts=("" "--dp=2 --zero=3")

same_as() {  # same_as CKPT REF WHAT: the model and the state files, bit for bit
  local ckpt=$1 ref=$2 what=$3
  for pair in "$ckpt $ref" "${ckpt%.safetensors}.state.safetensors ${ref%.safetensors}.state.safetensors"; do
    # shellcheck disable=SC2086
    if out=$(/usr/bin/python3 "$same" $pair 2>&1); then pass; else fail "$what: $out"; fi
  done
}

# The uninterrupted references, one per layout.
for i in "${!layouts[@]}"; do
  # shellcheck disable=SC2086
  "$gpt" "${common[@]}" ${layouts[$i]} --save="$dir/ref$i.safetensors" > /dev/null ||
    { echo "FAIL: the reference run ${layouts[$i]} failed"; exit 1; }
done

# ---- 1. kill -9 at each step of a save ------------------------------------------------------
points=(checkpoint.staged checkpoint.previous_state_kept checkpoint.previous_kept
        checkpoint.state_renamed checkpoint.committed train.step)
kills=0
for i in "${!layouts[@]}"; do
  for point in "${points[@]}"; do
    for hit in 1 3; do
      run="$dir/kill_${i}_${point}_$hit"
      mkdir -p "$run"
      ckpt="$run/c.safetensors"
      what="kill -9 at $point (hit $hit) ${layouts[$i]}"
      # shellcheck disable=SC2086
      TESSERA_FAULT="$point:kill:$hit" "$gpt" "${common[@]}" ${layouts[$i]} --save="$ckpt" \
        --save_every=2 > "$run/out.txt" 2>&1
      rc=$?
      kills=$((kills + 1))
      [ "$rc" -eq 137 ] || { fail "$what: exit $rc, expected 137 (SIGKILL)"; cat "$run/out.txt"; continue; }
      # Killed after step 1 (saves come every 2 steps) or inside the first save before its
      # model file was in place: no checkpoint exists yet, and the resume must say so
      # instead of loading half of one. (The previous_* points are first reached by the
      # second save: the first has no previous pair to keep.)
      no_checkpoint=0
      case "$point:$hit" in
        checkpoint.staged:1 | checkpoint.state_renamed:1 | train.step:1) no_checkpoint=1 ;;
      esac
      # shellcheck disable=SC2086
      "$gpt" "${common[@]}" ${layouts[$i]} --resume="$ckpt" --save="$ckpt" > "$run/resume.txt" 2>&1
      rc=$?
      if [ "$no_checkpoint" -eq 1 ]; then
        if [ "$rc" -eq 1 ] && grep -q "no complete checkpoint at $ckpt" "$run/resume.txt"; then
          pass
        else
          fail "$what: resuming before any complete save should fail clearly (exit $rc)"
          cat "$run/resume.txt"
        fi
        continue
      fi
      [ "$rc" -eq 0 ] || { fail "$what: resume exit $rc"; cat "$run/resume.txt"; continue; }
      same_as "$ckpt" "$dir/ref$i.safetensors" "$what"
      # No temporary file survives the next save.
      if ls "$run" | grep -q '\.tmp\.'; then fail "$what: stale temporaries: $(ls "$run")"; else pass; fi
    done
  done
done
echo "kill -9 at each save step: $kills kills"

# ---- 2. kill -9 at random moments --------------------------------------------------------------
# 100 steps, a save after each: most of the run is spent saving, so most kills land in one.
# On one rank RANDOM_KILLS times, on --dp=2 --zero=3 a third as often (each run is longer).
long=(--steps=100)
for i in "${!layouts[@]}"; do
  # shellcheck disable=SC2086
  set -- ${layouts[$i]}
  layout=("$@")
  kills=$random_kills
  [ "$i" -eq 0 ] || kills=$(((random_kills + 2) / 3))
  start=$(date +%s%N)
  "$gpt" "${common[@]}" "${long[@]}" "${layout[@]}" --save="$dir/ref_long$i.safetensors" \
    --save_every=1 > /dev/null
  duration_ms=$((($(date +%s%N) - start) / 1000000))
  resumed=0
  fresh=0
  for k in $(seq 1 "$kills"); do
    run="$dir/random_${i}_$k"
    mkdir -p "$run"
    ckpt="$run/c.safetensors"
    "$gpt" "${common[@]}" "${long[@]}" "${layout[@]}" --save="$ckpt" --save_every=1 \
      > /dev/null 2>&1 &
    pid=$!
    sleep "$(awk -v ms="$duration_ms" -v r="$RANDOM" 'BEGIN { printf "%.3f", ms * (r / 32767.0) / 1000 }')"
    kill -9 "$pid" 2> /dev/null
    wait "$pid" 2> /dev/null
    # The kill is verified by the resume: it continues from whatever was saved last.
    "$gpt" "${common[@]}" "${long[@]}" "${layout[@]}" --resume="$ckpt" --save="$ckpt" \
      > "$run/resume.txt" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ]; then
      resumed=$((resumed + 1))
      same_as "$ckpt" "$dir/ref_long$i.safetensors" "random kill $k ${layout[*]}"
    elif grep -q "no complete checkpoint at $ckpt" "$run/resume.txt" ||
         grep -q "is at step 100, at or past the end" "$run/resume.txt"; then
      fresh=$((fresh + 1))  # killed before the first save completed, or after the last
      pass
    else
      fail "random kill $k ${layout[*]}: resume exit $rc"
      cat "$run/resume.txt"
    fi
  done
  [ $((resumed + fresh)) -eq "$kills" ] || fail "random kills: $resumed + $fresh != $kills"
  echo "kill -9 at random moments${layout[*]:+ (${layout[*]})}: $kills kills in a" \
       "${duration_ms} ms run; $resumed resumed exactly, $fresh before the first or after the" \
       "last save"
done

# ---- 3. SIGTERM -------------------------------------------------------------------------------
run="$dir/sigterm"
mkdir -p "$run"
"$gpt" "${common[@]}" --steps=4000 --max_steps=4000 --save="$run/c.safetensors" \
  --metrics="$run/m.jsonl" --log_every=1 > "$run/out.txt" 2>&1 &
pid=$!
for _ in $(seq 1 600); do  # until it has trained a few steps (the handler is installed)
  [ -f "$run/m.jsonl" ] && [ "$(wc -l < "$run/m.jsonl")" -ge 3 ] && break
  sleep 0.05
done
kill -TERM "$pid"
wait "$pid"
rc=$?
step=$(sed -nE 's/.*stopped by SIGTERM after step ([0-9]+) of 4000.*/\1/p' "$run/out.txt")
if [ "$rc" -eq 143 ] && [ -n "$step" ] && grep -q "saved $run/c.safetensors" "$run/out.txt"; then
  pass
  # The same schedule (--steps), stopped 5 steps later, against a straight run to there.
  stop=$((step + 5))
  "$gpt" "${common[@]}" --steps=4000 --max_steps=$stop --resume="$run/c.safetensors" \
    --save="$run/c.safetensors" > /dev/null 2>&1 || fail "SIGTERM: resume failed"
  "$gpt" "${common[@]}" --steps=4000 --max_steps=$stop --save="$run/ref.safetensors" \
    > /dev/null 2>&1 || fail "SIGTERM: reference failed"
  same_as "$run/c.safetensors" "$run/ref.safetensors" "SIGTERM after step $step"
else
  fail "SIGTERM: exit $rc (expected 143), step '$step'"
  cat "$run/out.txt"
fi
run="$dir/sigterm_zero3"
mkdir -p "$run"
TESSERA_FAULT=train.step:term:5:1 "$gpt" "${common[@]}" --dp=2 --zero=3 \
  --save="$run/c.safetensors" > "$run/out.txt" 2>&1
rc=$?
if [ "$rc" -eq 143 ] && grep -q "stopped by SIGTERM after step 5 of 12" "$run/out.txt"; then
  pass
  "$gpt" "${common[@]}" --dp=2 --zero=3 --resume="$run/c.safetensors" \
    --save="$run/c.safetensors" > /dev/null 2>&1 || fail "SIGTERM --zero=3: resume failed"
  same_as "$run/c.safetensors" "$dir/ref1.safetensors" "SIGTERM --dp=2 --zero=3"
else
  fail "SIGTERM --dp=2 --zero=3: exit $rc (expected 143)"
  cat "$run/out.txt"
fi

# ---- 4. mnist: SIGTERM ------------------------------------------------------------------------
run="$dir/mnist_sigterm"
mkdir -p "$run"
mnist_args=(--model=mlp --train_limit=2048 --test_limit=200 --batch=64 --epochs=2 --max_steps=50
            --threads=1 --quiet)
"$mnist" "${mnist_args[@]}" --save="$run/ref.safetensors" > /dev/null 2>&1 ||
  fail "mnist: the reference run failed"
TESSERA_FAULT=train.step:term:20 "$mnist" "${mnist_args[@]}" --save="$run/c.safetensors" \
  > "$run/out.txt" 2>&1
rc=$?
if [ "$rc" -eq 143 ] && grep -q "mnist: stopped by SIGTERM after step 20 of 50; saved" "$run/out.txt"; then
  pass
  "$mnist" "${mnist_args[@]}" --resume="$run/c.safetensors" --save="$run/c.safetensors" \
    > /dev/null 2>&1 || fail "mnist SIGTERM: resume failed"
  same_as "$run/c.safetensors" "$run/ref.safetensors" "mnist SIGTERM after step 20"
else
  fail "mnist SIGTERM: exit $rc (expected 143)"
  cat "$run/out.txt"
fi

# ---- 5. mpirun: an error or a stall on one rank ends the whole job ------------------------
export HOME=$dir TMPDIR=$dir OMPI_MCA_plm_rsh_agent= OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl_vader_backing_directory=$dir
export OMP_NUM_THREADS=1
mpi_case() {  # mpi_case NAME EXPECTED_TEXT ENV... -- ARGS...
  local name=$1 expect=$2
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local t0=$SECONDS
  env "${envs[@]}" timeout --kill-after=5 60 mpirun --oversubscribe --allow-run-as-root -np 2 \
    "$gpt" "${common[@]}" --dp=2 --zero=1 "$@" > "$dir/mpi_$name.txt" 2>&1
  local rc=$? took=$((SECONDS - t0))
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && [ "$took" -lt 60 ] &&
     grep -qF -- "$expect" "$dir/mpi_$name.txt"; then
    pass
    echo "mpirun, $name: the job ended in ${took} s with exit $rc"
  else
    fail "mpirun, $name: exit $rc after ${took} s; expected a failure with '$expect'"
    cat "$dir/mpi_$name.txt"
  fi
}
mpi_case bad_save "--save=/nonexistent/d/x.safetensors: directory '/nonexistent/d' does not exist" \
  X=1 -- --save=/nonexistent/d/x.safetensors
mpi_case error_mid_run "rank 1 of 2 failed; aborting the other ranks: fault injection" \
  TESSERA_FAULT=train.step:throw:3:1 -- --steps=50
mpi_case stopped_rank "tessera watchdog: rank 0 of 2: all_reduce on group 'world'" \
  TESSERA_FAULT=train.step:stop:3:1 -- --steps=50 --comm_timeout=3

echo "$checks checks passed, $failures failed"
[ "$failures" -eq 0 ]
