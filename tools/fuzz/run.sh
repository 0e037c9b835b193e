#!/usr/bin/env bash
# Builds the fuzzers (tools/fuzz/BUILD) with clang, libFuzzer and the address + undefined
# sanitizers, and runs each for SECONDS on a copy of its seed corpus and its regressions.
# Prints one line per fuzzer (executions, coverage, corpus size, crashes) and exits non-zero
# when any fuzzer crashed; a crash's input is kept in $TESSERA_FUZZ_OUT/<fuzzer>/ (add it to
# tools/fuzz/regressions/<name>/ once fixed).
#
#   tools/fuzz/run.sh 60                         # every fuzzer, 60 s each (CI's smoke run)
#   tools/fuzz/run.sh 3600 safetensors idx       # the long run, on chosen fuzzers
#   tools/fuzz/run.sh --clang-build              # only: the whole tree (tests too) with clang
set -uo pipefail
cd "$(dirname "$0")/../.."

base=${TESSERA_FUZZ_OUTPUT_BASE:-$HOME/.cache/tessera-fuzz-bazel}
if [ "${1:-}" = "--clang-build" ]; then
  # Every package by name: //... would also walk the bazel-* links into the GCC build's
  # output base, which this second server does not recognise as its own.
  packages=(//:all)
  for d in */; do
    d=${d%/}
    case "$d" in bazel-*) continue ;; esac
    [ -f "$d/BUILD" ] || [ -n "$(find "$d" -name BUILD -print -quit)" ] && packages+=("//$d/...")
  done
  bazel --output_base="$base" build --config=fuzz --keep_going "${packages[@]}"
  rc=$?
  bazel --output_base="$base" shutdown
  exit $rc
fi

seconds=${1:-60}
shift || true
names=("$@")
[ "${#names[@]}" -gt 0 ] || names=(safetensors checkpoint idx text flags)
out=${TESSERA_FUZZ_OUT:-${TMPDIR:-/tmp}/tessera-fuzz-run}
# A second Bazel server with its own cache (base, above): clang objects never replace the
# GCC build's.

targets=()
for n in "${names[@]}"; do targets+=("//tools/fuzz:${n}_fuzzer"); done
if ! bazel --output_base="$base" build --config=fuzz "${targets[@]}" 2>&1 | tail -n 20; then
  echo "fuzz: the clang build failed"
  echo "0 passed, 1 failed"
  exit 1
fi
bin=$(bazel --output_base="$base" info --config=fuzz bazel-bin 2>/dev/null)
bazel --output_base="$base" shutdown  # its memory back before the fuzzers run

passed=0
failed=0
for n in "${names[@]}"; do
  work="$out/$n"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp tools/fuzz/corpus/"$n"/* "$work/corpus/"
  # -rss_limit_mb: a reader that allocates what a header claims (instead of what the file
  # holds) is a finding. TMPDIR: the targets' scratch files.
  TMPDIR="$work" ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$bin/tools/fuzz/${n}_fuzzer" -max_total_time="$seconds" -rss_limit_mb=2048 \
    -timeout=30 -print_final_stats=1 -artifact_prefix="$work/artifacts/" \
    "$work/corpus" tools/fuzz/regressions/"$n" > "$work/log.txt" 2>&1
  rc=$?
  execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$work/log.txt" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+' "$work/log.txt" | tail -1 | grep -oE '[0-9]+')
  ft=$(grep -oE 'ft: [0-9]+' "$work/log.txt" | tail -1 | grep -oE '[0-9]+')
  units=$(find "$work/corpus" -type f | wc -l)
  crashes=$(find "$work/artifacts" -type f | wc -l)
  echo "fuzz $n: ${execs:-0} executions in ${seconds} s, coverage ${cov:-0} edges (${ft:-0} features), corpus ${units} inputs, ${crashes} crashes (exit ${rc})"
  if [ "$rc" -eq 0 ] && [ "$crashes" -eq 0 ] && [ "${execs:-0}" -gt 0 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    grep -E "ERROR|SUMMARY|==[0-9]+==|runtime error|deadly signal" "$work/log.txt" | head -n 20
    ls "$work/artifacts"
  fi
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
