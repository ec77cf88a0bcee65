#!/usr/bin/env bash
# Run Molecule scenarios, MOLECULE_JOBS at a time (default 3: much of a scenario is waiting on
# containers booting and servers starting, so three overlap well on 2 cores). Each scenario's
# output goes to .cache/molecule-logs/<scenario>.log; a failed scenario's log tail is printed when
# it ends, and again, as its failing tests and tasks only, after the last scenario (where a CI
# log that keeps only its end still shows why). Each scenario's line says how long each of its
# Molecule actions took (the start of each is kept in .cache/molecule-logs/<scenario>.phases).
# Usage: scripts/molecule-all.sh SCENARIO...
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
logs="$repo/.cache/molecule-logs"
mkdir -p "$logs"
jobs=${MOLECULE_JOBS:-3}
declare -A pids=() started=()
failed=()
passed=()
[ "$#" -gt 0 ] || { echo "usage: $0 SCENARIO..." >&2; exit 2; }

plain() {  # $1 file: its text without terminal colours
  sed 's/\x1b\[[0-9;]*m//g' "$1"
}

run_scenario() {  # $1 scenario: its output to its log, the time each action starts to .phases
  local line
  : >"$logs/$1.phases"; rm -f "$logs/$1.runs.jsonl"
  cd "$repo" && molecule test -s "$1" 2>&1 | while IFS= read -r line || [ -n "$line" ]; do
    printf '%s\n' "$line"
    case $line in *Executing*) printf '%(%s)T %s\n' -1 "$line" >>"$logs/$1.phases" ;; esac
  done >"$logs/$1.log"
}

phases() {  # $1 scenario, $2 when it ended: "create 0m15s, prepare 0m20s, ..."
  plain "$logs/$1.phases" | sed -n 's/^\([0-9]*\) .* \([a-z_]*\): Executing$/\1 \2/p' |
    awk -v end="$2" '{ t[NR] = $1; p[NR] = $2 }
      END { for (i = 1; i <= NR; i++) { d = (i < NR ? t[i + 1] : end) - t[i]
              printf "%s%s %dm%02ds", (i > 1 ? ", " : ""), p[i], d / 60, d % 60 } }'
}

summary() {  # $1 scenario: assertion lines, failed tasks, pytest's short test summary
  # (Molecule draws a "  │ " margin before the output of what it runs and wraps it at 80
  # columns: the margin is taken off first; an assertion line keeps its wrapped continuation.)
  plain "$logs/$1.log" | sed 's/^ *│ \{0,1\}//' | awk '
    /short test summary info/ { in_summary = 1 }
    in_summary { print; if (/[0-9]+ (failed|passed|error)/) in_summary = 0; next }
    /^E  |^[a-zA-Z_.\/]+\.py:[0-9]+: |^(fatal|failed): / { print; wrapped = /^E  /; next }
    wrapped && /^  [^ ]/ { print; next }
    { wrapped = 0 }' | cut -c1-400 | tail -n 80
}

finish() {  # $1 scenario, $2 exit status
  local now took
  now=$(date +%s)
  took=$(( now - started[$1] ))
  if [ "$2" -eq 0 ]; then
    printf '==> molecule %-12s passed in %dm%02ds (%s)\n' "$1" $((took / 60)) $((took % 60)) \
      "$(phases "$1" "$now")"
    passed+=("$1")
  else
    printf '==> molecule %-12s FAILED after %dm%02ds (%s); last lines of %s:\n' \
      "$1" $((took / 60)) $((took % 60)) "$(phases "$1" "$now")" "$logs/$1.log"
    plain "$logs/$1.log" | tail -n 80
    failed+=("$1")
  fi
}

wait_one() {
  local s
  while :; do
    for s in "${!pids[@]}"; do
      if ! kill -0 "${pids[$s]}" 2>/dev/null; then
        wait "${pids[$s]}"; finish "$s" $?
        unset "pids[$s]"; return
      fi
    done
    sleep 2
  done
}

for s in "$@"; do
  while [ "${#pids[@]}" -ge "$jobs" ]; do wait_one; done
  echo "==> molecule test -s $s (log: .cache/molecule-logs/$s.log)"
  started[$s]=$(date +%s)
  run_scenario "$s" &
  pids[$s]=$!
done
while [ "${#pids[@]}" -gt 0 ]; do wait_one; done

if [ "${#failed[@]}" -gt 0 ] || [ "${#passed[@]}" -ne "$#" ]; then
  for s in "${failed[@]}"; do
    echo "==> why molecule $s failed (from $logs/$s.log):"
    summary "$s"
  done
  echo "==> Molecule scenarios failed: ${failed[*]:-} (passed ${#passed[@]} of $#)"
  exit 1
fi
echo "==> every Molecule scenario passed"
