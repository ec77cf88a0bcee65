#!/usr/bin/env bash
# Run Molecule scenarios, MOLECULE_JOBS at a time (default 3: much of a scenario is waiting on
# containers booting and servers starting, so three overlap well on 2 cores). Each scenario's
# output goes to .cache/molecule-logs/<scenario>.log; a failed scenario's log tail is printed when
# it ends, and again, as its failing tests and tasks only, after the last scenario (where a CI
# log that keeps only its end still shows why).
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

finish() {  # $1 scenario, $2 exit status
  local took=$(( $(date +%s) - started[$1] ))
  if [ "$2" -eq 0 ]; then
    printf '==> molecule %-12s passed in %dm%02ds\n' "$1" $((took / 60)) $((took % 60))
    passed+=("$1")
  else
    printf '==> molecule %-12s FAILED after %dm%02ds; last lines of %s:\n' \
      "$1" $((took / 60)) $((took % 60)) "$logs/$1.log"
    sed 's/\x1b\[[0-9;]*m//g' "$logs/$1.log" | tail -n 80
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
  (cd "$repo" && exec molecule test -s "$s") >"$logs/$s.log" 2>&1 &
  pids[$s]=$!
done
while [ "${#pids[@]}" -gt 0 ]; do wait_one; done

summary() {  # $1 scenario: pytest's failing tests and assertion lines, Ansible's failed tasks
  sed 's/\x1b\[[0-9;]*m//g' "$logs/$1.log" |
    grep -E '^(FAILED|ERROR) |^E  |^(fatal|failed): |^TASK \[|^[a-zA-Z_./]+\.py:[0-9]+: ' |
    grep -B1 -E '^(FAILED|ERROR) |^E  |^(fatal|failed): |\.py:[0-9]+: ' | grep -v '^--$' |
    cut -c1-400 | tail -n 60
}

if [ "${#failed[@]}" -gt 0 ] || [ "${#passed[@]}" -ne "$#" ]; then
  for s in "${failed[@]}"; do
    echo "==> why molecule $s failed (from $logs/$s.log):"
    summary "$s"
  done
  echo "==> Molecule scenarios failed: ${failed[*]:-} (passed ${#passed[@]} of $#)"
  exit 1
fi
echo "==> every Molecule scenario passed"
