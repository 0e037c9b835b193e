#!/usr/bin/env bash
# Runs every test binary of a GPU bundle (tools/gpu_bundle.sh) on the GPU machine, from the
# repository root, and ends with "N passed, N failed" like .ci/run:
#
#   tools/gpu_tests.sh .gpu_bundle/tessera_gpu.tar.xz [name-filter-regex]
#
# Logs: every test's output goes to $OUT/gpu_tests.log when OUT is set (else /tmp).
# Exit status: 0 only when every test passed and at least one ran (a filter matching no
# binary checks nothing). Each binary itself fails when it runs no test case or finds no
# CUDA device (tests/main.cc, tests/gpu_suite.cc).
set -uo pipefail
cd "$(dirname "$0")/.."
archive=${1:?usage: tools/gpu_tests.sh ARCHIVE [FILTER]}
filter=${2:-.}
dir=/tmp/tessera_gpu_bundle
rm -rf "$dir" && mkdir -p "$dir" && xz -dc "$archive" | tar -xf - -C "$dir"
source tools/gpu_env.sh "$dir"
log=${OUT:-/tmp}/gpu_tests.log
: > "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
passed=0 failed=0
for t in "$dir"/bin/*_test; do
  name=$(basename "$t")
  [[ $name =~ $filter ]] || continue
  start=$(date +%s%N)
  timeout "${TEST_TIMEOUT:-300}" "$t" >"/tmp/$name.out" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  secs=$(printf "%d.%03d" $((ms / 1000)) $((ms % 1000)))
  { echo "===== $name rc=$rc ${secs}s"; cat "/tmp/$name.out"; } >>"$log"
  if [[ $rc -eq 0 ]]; then
    passed=$((passed + 1)); printf 'PASS %-28s %6.1fs  %s\n' "$name" "$secs" "$(grep -E '^\[doctest\] (test cases|assertions)' "/tmp/$name.out" | tr -s ' ' | tr '\n' ' ')"
  else
    failed=$((failed + 1)); printf 'FAIL %-28s %6.1fs rc=%d\n' "$name" "$secs" "$rc"
    grep -E "ERROR|error|FAILED|Error" "/tmp/$name.out" | head -8 | cut -c1-300
  fi
done
echo "$passed passed, $failed failed"
if [[ $passed -eq 0 && $failed -eq 0 ]]; then
  echo "no test binary in $archive matches '$filter'"
  exit 1
fi
[[ $failed -eq 0 ]]
