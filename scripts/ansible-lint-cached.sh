#!/usr/bin/env bash
# ansible-lint (production profile), skipped when the very files it reads already passed it.
#
# ansible-lint is most of `make check`'s lint time: about 80 CPU-seconds, nearly all of them one
# `ansible-playbook --syntax-check` per playbook and role (2026-12-05, 2 cores). Its result
# depends only on what it reads, so a pass is recorded under a key of that: the versions of
# ansible-lint and ansible-core, and the content and path of every file git does not ignore,
# except the ones it never reads (Markdown, docs/, the Python tests, bench/). The same key
# again skips the run and says so; any change to a role, playbook, plugin, module, sglang_fleet
# (the plugins import it) or the lint configuration runs it in full. A fresh clone has no
# record and runs it. ANSIBLE_LINT_CACHE=0 always runs it. Records live in .ansible/ (ignored
# by git, ansible-lint's own folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
record_dir=.ansible/ansible-lint-passed

key() {
  git ls-files -z --cached --others --exclude-standard -- . \
    ':(exclude,glob)**/*.md' ':(exclude)docs' ':(exclude,glob)tests/**/*.py' ':(exclude)bench' \
    | "$bin/python" -c '
import hashlib, importlib.metadata as meta, os, sys
key = hashlib.sha1((meta.version("ansible-lint") + " " + meta.version("ansible-core")).encode())
for path in sorted(p for p in sys.stdin.buffer.read().split(b"\0") if p):
    if os.path.islink(path):  # a link (the roles templates/ folders) by where it points
        what = b"link " + os.readlink(path)
    elif os.path.isfile(path):
        what = hashlib.sha1(open(path, "rb").read()).hexdigest().encode()
    else:  # deleted, not yet staged
        what = b"missing"
    key.update(path + b"\0" + what + b"\0")
print(key.hexdigest())'
}

if [[ "${ANSIBLE_LINT_CACHE:-1}" == 0 ]]; then
  exec "$bin/ansible-lint" --profile production
fi
stamp="$record_dir/$(key)"
if [[ -e "$stamp" ]]; then
  echo "ansible-lint: these files passed already ($(cat "$stamp")); not run again (ANSIBLE_LINT_CACHE=0 runs it)"
  exit 0
fi
"$bin/ansible-lint" --profile production
# A file changed while it ran: what passed is not what the key names.
if [[ "$record_dir/$(key)" == "$stamp" ]]; then
  mkdir -p "$record_dir"
  date -u +%Y-%m-%dT%H:%M:%SZ > "$stamp"
fi
