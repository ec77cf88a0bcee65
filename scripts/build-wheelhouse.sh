#!/usr/bin/env bash
# Build .cache/wheelhouse: what the test hosts' ml-env installs, offline, through the ml_env
# role's wheelhouse variable (as an air-gapped GPU host would): the pinned SGLang wheel (installed
# --no-deps on GPU-less hosts) and the GPU-less double with its dependencies; and
# .cache/router-wheelhouse: the pinned sglang-router with its dependencies, which the
# sglang_router role installs on a gateway host. Both for the hosts' Python (Debian 12: CPython
# 3.11, x86_64). The index comes from pip's own configuration.
set -euo pipefail
say() { printf '==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/.cache/wheelhouse"
router_out="$repo/.cache/router-wheelhouse"
pip="$repo/.venv/bin/pip"
sglang_version=$(awk -F': *' '/^ml_env_sglang_version:/ {gsub(/"/, "", $2); print $2}' \
  "$repo/roles/ml_env/defaults/main.yml")
router_version=$(awk -F': *' '/^sglang_router_version:/ {gsub(/"/, "", $2); print $2}' \
  "$repo/roles/sglang_router/defaults/main.yml")
host_reqs="$repo/gpusim/requirements-host.txt"
stamp_key=$( { echo "$sglang_version"; echo "$router_version"; cat "$host_reqs"; } | sha256sum | cut -c1-12)
mkdir -p "$out" "$router_out"
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither' >&2) >/dev/null; }

if [ "$(cat "$out/.downloads" 2>/dev/null)" != "$stamp_key" ]; then
  say "downloading sglang==$sglang_version and the double's dependencies for CPython 3.11"
  target=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
          --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform any)
  quiet "$pip" download --disable-pip-version-check --no-deps -d "$out" "${target[@]}" "sglang==$sglang_version"
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
say "wheelhouse ready: $(find "$out" -name '*.whl' | wc -l) wheels in $out"
# One archive for the simulated test hosts (wheelhouse + the double's fixture models): a single
# transfer is far quicker than copying each file over a docker or SSH connection.
tar -C "$repo/.cache" -cf "$repo/.cache/testhost-payload.tar" wheelhouse \
  -C "$repo/gpusim/gpusim" --transform 's,^fixtures,models,' fixtures
tar -C "$repo/.cache" -cf "$repo/.cache/testhost-router-payload.tar" router-wheelhouse
say "test-host payloads: $repo/.cache/testhost-payload.tar, testhost-router-payload.tar (gateways)"
