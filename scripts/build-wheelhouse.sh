#!/usr/bin/env bash
# Build .cache/wheelhouse: what the test hosts install, offline, through the roles' wheelhouse
# variables (as an air-gapped GPU host would): the pinned SGLang wheel (installed --no-deps on
# GPU-less hosts), the GPU-less double with its dependencies, and the pinned sglang-router with
# its dependencies (the sglang_router role on the gateway host), for the hosts' Python
# (Debian 12: CPython 3.11, x86_64). The index comes from pip's own configuration.
set -euo pipefail
say() { printf '==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/.cache/wheelhouse"
pip="$repo/.venv/bin/pip"
sglang_version=$(awk -F': *' '/^ml_env_sglang_version:/ {gsub(/"/, "", $2); print $2}' \
  "$repo/roles/ml_env/defaults/main.yml")
router_version=$(awk -F': *' '/^sglang_router_version:/ {gsub(/"/, "", $2); print $2}' \
  "$repo/roles/sglang_router/defaults/main.yml")
host_reqs="$repo/gpusim/requirements-host.txt"
stamp_key=$( { echo "$sglang_version"; echo "$router_version"; cat "$host_reqs"; } | sha256sum | cut -c1-12)
mkdir -p "$out"
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither' >&2) >/dev/null; }

if [ "$(cat "$out/.downloads" 2>/dev/null)" != "$stamp_key" ]; then
  say "downloading sglang==$sglang_version, sglang-router==$router_version and the double's dependencies for CPython 3.11"
  target=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
          --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform any)
  quiet "$pip" download --disable-pip-version-check --no-deps -d "$out" "${target[@]}" "sglang==$sglang_version"
  quiet "$pip" download --disable-pip-version-check -d "$out" "${target[@]}" -r "$host_reqs"
  # The router's wheel is abi3 (any CPython >= 3.8); its dependencies (fastapi, uvicorn, orjson,
  # pydantic, ...) are resolved for 3.11 like the rest (docs/ROUTER.md, "Package and launch").
  quiet "$pip" download --disable-pip-version-check -d "$out" "${target[@]}" \
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
say "test-host payload: $repo/.cache/testhost-payload.tar"
