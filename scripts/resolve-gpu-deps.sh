#!/usr/bin/env bash
# Resolve the pinned SGLang's full GPU dependency set for Python 3.11 on x86-64 Linux, without
# installing anything: a pin that no longer resolves is found on the controller, not on a GPU
# host. Prints the package count and the torch / CUDA / flashinfer / sglang-kernel versions.
#
# Usage: scripts/resolve-gpu-deps.sh [SGLANG_VERSION]   (default: ml_env_sglang_version)
#   Env: RESOLVE_REPORT  where pip's JSON report goes (default .cache/gpu-deps-report.json)
# The index is whatever pip's own configuration says; this script names none.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
version=${1:-$(sed -n 's/^ml_env_sglang_version: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$repo/roles/ml_env/defaults/main.yml")}
report=${RESOLVE_REPORT:-$repo/.cache/gpu-deps-report.json}
python=${PYTHON:-$repo/.venv/bin/python}
mkdir -p "$(dirname "$report")"

# manylinux tags are not widened by pip when --platform is given: list the glibc levels a GPU
# host of ml_env's distributions (Debian 12: glibc 2.36, Ubuntu 22.04: 2.35) accepts.
platforms=()
for minor in $(seq 35 -1 5); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
for tag in manylinux2014 manylinux2010 manylinux1 linux; do
  platforms+=(--platform "${tag}_x86_64")
done

# pip takes platform options only with --target; --dry-run writes nothing there.
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT

echo "==> resolving sglang==$version for CPython 3.11, x86_64 (dry run, nothing installed)"
"$python" -m pip install --dry-run --ignore-installed --quiet --no-input \
  --target "$target" --report "$report" --python-version 3.11 --implementation cp --abi cp311 "${platforms[@]}" \
  --only-binary=:all: "sglang==$version" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)

driver_cuda=$(sed -n 's/^nvidia_driver_cuda_major: *\([0-9]*\).*/\1/p' "$repo/roles/nvidia_driver/defaults/main.yml")
"$python" - "$report" "$driver_cuda" <<'PY'
import json
import re
import sys

items = json.load(open(sys.argv[1]))["install"]
meta = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"] for i in items}
print(f"packages: {len(items)}")
for name in ("sglang", "torch", "flashinfer-python", "sglang-kernel", "triton"):
    print(f"{name}: {meta[name]['version'] if name in meta else 'not in the set'}")
# The CUDA torch is built for: its own pin of NVIDIA's cuda-toolkit (torch 2.14.1:
# cuda-toolkit[...]==13.0.3), as the installed cuda-toolkit confirms.
pins = [r for r in meta["torch"].get("requires_dist", []) if r.startswith("cuda-toolkit")]
pinned = re.search(r"==\s*(\d+)\.", pins[0]) if pins else None
if pinned is None or "cuda-toolkit" not in meta:
    sys.exit("torch in this set pins no cuda-toolkit: not a CUDA build?")
major = pinned[1]
print(f"CUDA: {major} (torch pins {pins[0].split(';')[0]}; cuda-toolkit {meta['cuda-toolkit']['version']})")
if major != sys.argv[2]:
    sys.exit(
        f"nvidia_driver_cuda_major is {sys.argv[2]} in roles/nvidia_driver/defaults/main.yml, "
        f"but the pinned SGLang's torch is built for CUDA {major}: update it (and the branch)"
    )
print(f"nvidia_driver_cuda_major {sys.argv[2]} matches")
PY
