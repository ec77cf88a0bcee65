#!/usr/bin/env bash
# Build .cache/wheelhouse: what the test hosts' ml-env installs, offline, through the ml_env
# role's wheelhouse variable (as an air-gapped GPU host would): the pinned SGLang wheel and the
# previous release's (installed --no-deps on GPU-less hosts), the GPU-less double with its
# dependencies, a stand-in "<pinned>+regressed" (the upgrade scenario's slow version; see
# below); and
# .cache/router-wheelhouse: the pinned sglang-router with its dependencies, which the
# sglang_router role installs on a gateway host. Both for the hosts' Python (Debian 12: CPython
# 3.11, x86_64). The index comes from pip's own configuration.
#
# `build-wheelhouse.sh cpu` builds .cache/cpu-wheelhouse instead: SGLang's CPU engine set (every
# pin of gpusim/tools/sglang-0.5.23-cpu.lock, torch as the CPU build that pip's find-links hold)
# plus wheels of the torchvision and sgl_kernel import stand-ins, which the ml_env role installs
# with ml_env_accelerator: cpu (roles/ml_env/README.md, "CPU"). About 650 MB of wheels (2 GB installed): only the
# real-SGLang scenario carries it (.cache/testhost-cpu-payload.tar), never the double's hosts.
# `build-wheelhouse.sh cpu-key` prints the key of that set without downloading anything.
set -euo pipefail
say() { printf '==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/.cache/wheelhouse"
router_out="$repo/.cache/router-wheelhouse"
pip="$repo/.venv/bin/pip"
sglang_version=$(awk -F': *' '/^ml_env_sglang_version:/ {gsub(/"/, "", $2); print $2}' \
  "$repo/roles/ml_env/defaults/main.yml")
# The SGLang release before the pinned one: the upgrade scenario installs it (its own virtualenv
# beside the pinned version's) and upgrades from it. Its real wheel, --no-deps like the pinned one.
sglang_previous_version=0.5.22
# A stand-in "sglang" of the pinned version with a local version label (metadata and an empty
# package, no SGLang code; built below): the double's sglang_version_slowdown knob
# (gpusim/README.md, "Versions") makes this exact version slow, so that the upgrade scenario can
# roll out a version that regresses. It sits beside the real wheel: PEP 440 lets
# `sglang==<pinned>` match `<pinned>+regressed` (and pip would prefer it), which is why the
# ml_env role asks pip for SGLang with `===`, the exact string (roles/ml_env/README.md).
sglang_regressed_version="$sglang_version+regressed"
router_version=$(awk -F': *' '/^sglang_router_version:/ {gsub(/"/, "", $2); print $2}' \
  "$repo/roles/sglang_router/defaults/main.yml")
host_reqs="$repo/gpusim/requirements-host.txt"
stamp_key=$( { echo "$sglang_version"; echo "$sglang_previous_version"; echo "$router_version"
  cat "$host_reqs"; } | sha256sum | cut -c1-12)
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither' >&2) >/dev/null; }
target=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)

# A wheel of an import stand-in (gpusim/tools/<dir>/<package>): a distribution of its own name,
# so that nothing claims to be the real torchvision or sgl_kernel.
stand_in_wheel() {  # $1 distribution name, $2 source dir holding the package, $3 package
  local build
  build=$(mktemp -d)
  cp -r "$2/$3" "$build/"
  find "$build" -name __pycache__ -prune -exec rm -rf {} +
  cat >"$build/pyproject.toml" <<EOF
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"
[project]
name = "$1"
version = "1.0.0"
description = "Import stand-in for $3 on SGLang's CPU engine (sglang-fleet, $2)"
requires-python = ">=3.11"
[tool.setuptools.packages.find]
include = ["$3*"]
EOF
  quiet "$pip" wheel --disable-pip-version-check --no-deps -w "$cpu_out" "$build"
  rm -rf "$build"
}

if [ "${1:-}" = cpu ] || [ "${1:-}" = cpu-key ]; then
  cpu_out="$repo/.cache/cpu-wheelhouse"
  lock="$repo/gpusim/tools/sglang-$sglang_version-cpu.lock"
  tools="$repo/gpusim/tools"
  [ -f "$lock" ] || { echo "build-wheelhouse: no CPU lock for sglang $sglang_version: $lock" >&2; exit 1; }
  # What decides the CPU set's content: the lock's pins and the stand-ins' source. A pinned
  # download is the same file wherever it is made, so this key names the set before (and
  # without) downloading it: `cpu-key` prints it for the CPU test-host layer's tag.
  cpu_key=$( { cat "$lock"; find "$tools/torchvision_stub" "$tools/sgl_kernel_stub" -name '*.py' \
    -print0 | sort -z | xargs -0 cat; } | sha256sum | cut -c1-12)
  if [ "$1" = cpu-key ]; then echo "$cpu_key"; exit 0; fi
  mkdir -p "$cpu_out"
  if [ "$(cat "$cpu_out/.downloads" 2>/dev/null)" != "$cpu_key" ]; then
    say "downloading SGLang's CPU set for CPython 3.11 ($(grep -cE '^[A-Za-z0-9].*==' "$lock") pins of $lock; about 650 MB)"
    rm -f "$cpu_out"/sglang_fleet_*.whl  # pip download keeps the wheels it finds
    quiet "$pip" download --disable-pip-version-check --no-deps -d "$cpu_out" "${target[@]}" -r "$lock"
    say "building the torchvision and sgl_kernel stand-in wheels"
    stand_in_wheel sglang-fleet-torchvision-stand-in "$tools/torchvision_stub" torchvision
    stand_in_wheel sglang-fleet-sgl-kernel-stand-in "$tools/sgl_kernel_stub" sgl_kernel
    if find "$cpu_out" -name 'nvidia_*' | grep -q .; then
      echo "build-wheelhouse: NVIDIA wheels in the CPU set: $(find "$cpu_out" -name 'nvidia_*')" >&2
      exit 1
    fi
    tar -C "$repo/.cache" -cf "$repo/.cache/testhost-cpu-payload.tar" cpu-wheelhouse
    echo "$cpu_key" >"$cpu_out/.downloads"
  fi
  say "CPU wheelhouse ready: $(find "$cpu_out" -name '*.whl' | wc -l) wheels, $(du -sh "$cpu_out" | cut -f1) in $cpu_out"
  exit 0
fi

mkdir -p "$out" "$router_out"

if [ "$(cat "$out/.downloads" 2>/dev/null)" != "$stamp_key" ]; then
  say "downloading sglang==$sglang_version, sglang==$sglang_previous_version and the double's dependencies for CPython 3.11"
  quiet "$pip" download --disable-pip-version-check --no-deps -d "$out" "${target[@]}" "sglang==$sglang_version"
  quiet "$pip" download --disable-pip-version-check --no-deps -d "$out" "${target[@]}" \
    "sglang==$sglang_previous_version"
  quiet "$pip" download --disable-pip-version-check -d "$out" "${target[@]}" -r "$host_reqs"
  # The router's wheel is abi3 (any CPython >= 3.8); its dependencies (fastapi, uvicorn, orjson,
  # pydantic, ...) are resolved for 3.11 like the rest (docs/ROUTER.md, "Package and launch").
  # A wheelhouse of its own: only gateway hosts get it (30 MB that the other hosts never need).
  say "downloading sglang-router==$router_version and its dependencies for CPython 3.11"
  rm -f "$router_out"/*.whl
  quiet "$pip" download --disable-pip-version-check -d "$router_out" "${target[@]}" \
    "sglang-router==$router_version"
  echo "$stamp_key" >"$out/.downloads"
fi
say "building the gpusim wheel"
rm -f "$out"/gpusim-*.whl
quiet "$pip" wheel --disable-pip-version-check --no-deps -w "$out" "$repo/gpusim"
say "building the sglang==$sglang_regressed_version stand-in wheel"
rm -rf "$out/regressed"  # where an earlier version of this script kept it
# Like molecule/provision/verify_ml_env_changes.yml's stand-ins (METADATA, WHEEL, RECORD with
# sha256), with fixed timestamps so that the same version makes the same bytes.
"$repo/.venv/bin/python" - "$out" "$sglang_regressed_version" <<'PY'
import base64, hashlib, pathlib, sys, zipfile
out, version = pathlib.Path(sys.argv[1]), sys.argv[2]
info = f"sglang-{version}.dist-info"
files = {
    "sglang/__init__.py": f'__version__ = "{version}"  # sglang-fleet stand-in: no SGLang code\n',
    f"{info}/METADATA": f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\nSummary: "
    "sglang-fleet stand-in (scripts/build-wheelhouse.sh): metadata only, for gpusim's "
    "sglang_version_slowdown\n",
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: sglang-fleet build-wheelhouse.sh\n"
    "Root-Is-Purelib: true\nTag: py3-none-any\n",
}
def record(name, data):
    digest = hashlib.sha256(data.encode()).digest()
    b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
    return f"{name},sha256={b64},{len(data.encode())}"
rows = [record(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
files[f"{info}/RECORD"] = "\n".join(rows) + "\n"
with zipfile.ZipFile(out / f"sglang-{version}-py3-none-any.whl", "w") as whl:
    for name, data in files.items():
        entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        entry.external_attr = 0o644 << 16
        whl.writestr(entry, data)
PY
say "wheelhouse ready: $(find "$out" -maxdepth 1 -name '*.whl' | wc -l) wheels in $out"
# One archive for the simulated test hosts (wheelhouse + the double's fixture models): a single
# transfer is far quicker than copying each file over a docker or SSH connection.
tar -C "$repo/.cache" -cf "$repo/.cache/testhost-payload.tar" wheelhouse \
  -C "$repo/gpusim/gpusim" --transform 's,^fixtures,models,' fixtures
tar -C "$repo/.cache" -cf "$repo/.cache/testhost-router-payload.tar" router-wheelhouse
say "test-host payloads: $repo/.cache/testhost-payload.tar, testhost-router-payload.tar (gateways)"
