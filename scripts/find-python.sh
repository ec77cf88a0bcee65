#!/usr/bin/env bash
# Print a Python >= 3.12 interpreter for the control-node venv (ansible-core 2.21 needs it).
# Tries python3.12 and python3.13 from PATH; a pyenv shim that is not activated fails its
# version check, so pyenv's own installed versions are tried next.
set -u
ok() { "$1" -c 'import sys; raise SystemExit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
for candidate in python3.12 python3.13; do
  if command -v "$candidate" >/dev/null 2>&1 && ok "$candidate"; then
    command -v "$candidate"; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9](\.[0-9]+)?$' | sort -V); do
    candidate="$root/versions/$v/bin/python3"
    if ok "$candidate"; then echo "$candidate"; exit 0; fi
  done
fi
echo "ERROR: no Python >= 3.12 found (tried python3.13, python3.12 and pyenv versions)." >&2
echo "       ansible-core 2.21 needs it: install python3.12 or python3.13 and rerun." >&2
exit 1
