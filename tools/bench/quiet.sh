# Sourced by the benchmark scripts: wait_for_quiet blocks (up to QUIET_TIMEOUT seconds)
# until the CPUs were at least QUIET_IDLE percent idle over 2 s and the 1-minute load
# average is below QUIET_LOAD. QUIET_IDLE=0 skips the wait.
QUIET_IDLE=${QUIET_IDLE:-95}
QUIET_LOAD=${QUIET_LOAD:-0.3}
QUIET_TIMEOUT=${QUIET_TIMEOUT:-900}

# Percent of CPU time idle over the next 2 seconds (from /proc/stat).
idle_percent() {
  local a b
  a=($(awk '/^cpu /{print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat))
  sleep 2
  b=($(awk '/^cpu /{print $5 + $6, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat))
  echo $(( 100 * (b[0] - a[0]) / (b[1] - a[1] + 1) ))
}

wait_for_quiet() {
  [ "$QUIET_IDLE" -le 0 ] && return 0
  local start=$SECONDS idle
  while true; do
    idle=$(idle_percent)
    if [ "$idle" -ge "$QUIET_IDLE" ] &&
       awk -v l="$(cut -d' ' -f1 /proc/loadavg)" -v max="$QUIET_LOAD" 'BEGIN { exit !(l < max) }'; then
      echo "[machine ${idle}% idle; load $(cut -d' ' -f1-3 /proc/loadavg)]" >&2
      return 0
    fi
    if [ $((SECONDS - start)) -ge "$QUIET_TIMEOUT" ]; then
      echo "[warning: machine busy (${idle}% idle, load $(cut -d' ' -f1 /proc/loadavg))" \
           "after ${QUIET_TIMEOUT}s; running anyway]" >&2
      return 0
    fi
  done
}

