#!/usr/bin/env bash
# Build the SGLang 0.5.23 reference environment: a CPU-only Python 3.11 venv in which the real
# `python -m sglang.launch_server --help` and `python -m sglang.benchmark.serving --help` run.
# gpusim's flag table (gpusim/gpusim/flags/sglang-0.5.23.json) is dumped from it, and
# tests/double/test_flags_match_real.py compares the test double against it.
#
# Usage: scripts/sglang-reference-env.sh [DIR]
#   DIR: where to build. Without it, the venv is built once per machine in the user's cache
#   (${XDG_CACHE_HOME:-~/.cache}/sglang-fleet/sglang-ref, as pip keeps its own cache there) and
#   <repo>/.cache/sglang-ref links to it, so that a fresh clone finds it built, as it finds the
#   test-host images; a clone whose .cache/sglang-ref is a folder of its own keeps using it.
#   Env: SGLANG_REF_PYTHON  interpreter to build with (default: python3.11, else python3; must be 3.11
#                           because the sglang 0.5.23 wheel is cp311)
#
# Idempotent: DIR/venv/.stamp holds a hash of this script, the lock file and the stand-ins'
# source; when it matches, the script only says so and exits. Anything else is rebuilt from
# scratch. The stand-ins are copied into DIR (a clone that built the venv may be gone later).
#
# Why the install looks like this (docs/SGLANG.md, "Its benchmark client on a machine without a
# GPU"): sglang's declared dependencies pull CUDA torch, flashinfer and ~4.5 GB of NVIDIA
# libraries. Every package of gpusim/tools/sglang-0.5.23-cpu.lock (the one CPU lock, also read by
# the ml_env role) is therefore installed with --no-deps, so pip never resolves anything itself:
# torch is the CPU wheel (2.13.0+cpu; why not the pinned 2.14.1: the lock file says). torchvision
# and sgl_kernel are small stand-in packages from this repository (gpusim/tools/*_stub, test
# infrastructure), put on the venv's path by a .pth file. With them the env also runs a real
# CPU server (SGLANG_USE_CPU_ENGINE=1, see docs/SGLANG.md). The index is whatever pip's own
# configuration says; this script names none.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
link=$repo/.cache/sglang-ref
if [[ -n ${1:-} ]]; then
  dir=$1
elif [[ -d $link && ! -L $link ]]; then
  dir=$link
else
  dir=${XDG_CACHE_HOME:-$HOME/.cache}/sglang-fleet/sglang-ref
  mkdir -p "$dir" "$repo/.cache"
  ln -sfn "$dir" "$link"
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
venv=$dir/venv
lockfile=$repo/gpusim/tools/sglang-0.5.23-cpu.lock
stub=$repo/gpusim/tools/torchvision_stub
kernel_stub=$repo/gpusim/tools/sgl_kernel_stub
started=$SECONDS

say() { printf '==> [%3ds] %s\n' "$((SECONDS - started))" "$*"; }
die() { printf 'sglang-reference-env: %s\n' "$*" >&2; exit 1; }

pick_python() {
  local candidate
  for candidate in "${SGLANG_REF_PYTHON:-}" python3.11 python3; do
    [[ -n $candidate ]] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}


# pip warns once per configured local index folder that lacks a package; that is noise here.
quiet_pip() {
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}

smoke() {
  local module=$1
  say "check: python -m $module --help"
  HF_HUB_OFFLINE=1 timeout 300 "$venv/bin/python" -W ignore -m "$module" --help >"$dir/$module.help" 2>&1 \
    || { tail -n 30 "$dir/$module.help" >&2; die "python -m $module --help failed"; }
}

main() {
  [[ -d $stub/torchvision ]] || die "torchvision stand-in missing: $stub/torchvision"
  [[ -d $kernel_stub/sgl_kernel ]] || die "sgl_kernel stand-in missing: $kernel_stub/sgl_kernel"
  [[ -f $lockfile ]] || die "lock file missing: $lockfile"
  local key
  key=$( { cat "${BASH_SOURCE[0]}" "$lockfile"; find "$stub" "$kernel_stub" -name '*.py' -print0 \
    | sort -z | xargs -0 cat; } | sha256sum | cut -d' ' -f1)

  exec 9>"$dir/.lock"
  flock 9  # two concurrent `make test` runs must not build into one folder at once
  if [[ -x $venv/bin/python && "$(cat "$venv/.stamp" 2>/dev/null)" == "$key" ]]; then
    say "SGLang reference env is up to date: $venv"
    return 0
  fi

  local python
  python=$(pick_python) || die "need Python 3.11 (sglang 0.5.23 ships cp311 wheels); set SGLANG_REF_PYTHON"
  say "building SGLang 0.5.23 reference env in $venv with $python ($("$python" --version))"
  rm -rf "$venv"
  "$python" -m venv "$venv"

  say "installing $(grep -c '^[^#].*==' "$lockfile") pinned packages from $lockfile with --no-deps (index from pip's config)"
  # --no-compile: byte-compiling ~2 GB of torch/triton/sglang is most of the install CPU; the
  # few modules `--help` imports compile on first use instead.
  quiet_pip install --no-deps --no-compile --only-binary=:all: --progress-bar off --no-input \
    -r "$lockfile"

  local site stand_ins=$dir/stand-ins
  say "putting the torchvision and sgl_kernel stand-ins on the venv's path: $stand_ins"
  rm -rf "$stand_ins"
  mkdir -p "$stand_ins/torchvision_stub" "$stand_ins/sgl_kernel_stub"
  cp -r "$stub/torchvision" "$stand_ins/torchvision_stub/"
  cp -r "$kernel_stub/sgl_kernel" "$stand_ins/sgl_kernel_stub/"
  find "$stand_ins" -name __pycache__ -prune -exec rm -rf {} +
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  printf '%s\n' "$stand_ins/torchvision_stub" "$stand_ins/sgl_kernel_stub" >"$site/sglang_ref_stubs.pth"

  smoke sglang.launch_server
  smoke sglang.benchmark.serving

  printf '%s\n' "$key" >"$venv/.stamp"
  say "done: $venv ($(du -sh "$venv" | cut -f1))"
}

main
