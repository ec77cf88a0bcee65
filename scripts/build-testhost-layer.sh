#!/usr/bin/env bash
# Build a provisioned test-host image: the Molecule test host (scripts/build-test-image.sh) with
# a playbook already run over it, committed as a layer. Installing wheels into a fresh container
# costs minutes on 2 cores; scenarios that do not test provisioning start from a layer instead.
# Usage: scripts/build-testhost-layer.sh double|cpu
#   double: the GPU-less double installed (molecule/shared/install_double.yml) and the ml_env
#           role run with the shared simulated-host settings: sglang-fleet-testhost-double, for
#           the scenarios that roll out servers (they run deploy.yml as an operator does after
#           provision.yml). The deploy and provision scenarios still provision from scratch.
#   cpu:    the ml_env role in SGLang's CPU set (ml_env_accelerator: cpu, .cache/cpu-wheelhouse):
#           sglang-fleet-testhost-cpu, for molecule/real_sglang, which proves the layer by running
#           ml_env over it again (that run must change nothing and its verify must find every
#           pinned version, molecule/real_sglang/tests/test_real_sglang.py).
# Cached: the tag carries a hash of what decides the layer's content (the base image's recipe
# tag, the payloads, the playbook and its settings, the roles it runs, this script); a stale
# layer is rebuilt, and removing the images rebuilds them too.
set -euo pipefail

say() { printf '==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
layer=${1:-}
base=sglang-fleet-testhost:latest
case "$layer" in
  double)
    payloads=("$repo/.cache/testhost-payload.tar" "$repo/.cache/testhost-router-payload.tar")
    settings="$repo/molecule/shared/inventory/group_vars/all/simulated_host.yml"
    playbook="$repo/molecule/shared/testhost_layer.yml"
    inputs=("$repo/molecule/shared/install_double.yml" "$repo"/roles/ml_env/*/*.yml
            "$repo/plugins/modules/ml_env_versions.py")
    copy_in=false  # install_double.yml unpacks them, as on a plain test host
    ;;
  cpu)
    payloads=("$repo/.cache/testhost-cpu-payload.tar")
    settings="$repo/molecule/real_sglang/inventory/group_vars/gpu_hosts/ml_env.yml"
    playbook="$repo/molecule/real_sglang/ml_env_layer.yml"
    # The CPU set's key (its lock and stand-ins) stands for its 650 MB payload, which is
    # downloaded only when the layer is built: a fresh clone on a machine that has the layer
    # skips the download (docs/TESTING.md, "The suite's order").
    inputs=("$repo/gpusim/tools/sglang-0.5.23-cpu.lock"
            "$repo/roles/ml_env/defaults/main.yml" "$repo/roles/ml_env/vars/main.yml"
            "$repo/plugins/modules/ml_env_versions.py")
    copy_in=true
    ;;
  *) echo "usage: $0 double|cpu" >&2; exit 2 ;;
esac

# The base by its recipe tag (scripts/build-test-image.sh), not its id: a rebuild of the same
# recipe elsewhere on the machine must not invalidate this layer.
# The double's payloads by what they hold, not their bytes: the pinned wheels by name (a pinned
# download is the same file wherever it is made) and the double by its source (its wheel and the
# archives carry the time they were built, so a fresh clone would otherwise rebuild the layer).
payload_identity() {
  (cd "$repo/.cache" && find wheelhouse router-wheelhouse -name '*.whl' ! -name 'gpusim-*' | sort)
  (cd "$repo" && find gpusim -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' \
     ! -path 'gpusim/build/*' ! -path 'gpusim/tools/*' | sort | xargs sha256sum)
}
recipe_hash=$( { docker image inspect -f '{{join .RepoTags " "}}' "$base" | tr ' ' '\n' | grep -v ':latest$';
  cat "$0" "$settings" "$playbook" "${inputs[@]}";
  if [ "$layer" = double ]; then payload_identity; else "$repo/scripts/build-wheelhouse.sh" cpu-key; fi; } \
  | sha256sum | cut -c1-12)
image="sglang-fleet-testhost-$layer:$recipe_hash"
if docker image inspect "$image" >/dev/null 2>&1; then
  say "$layer test-host layer $image is up to date"
  docker tag "$image" "sglang-fleet-testhost-$layer:latest"
  exit 0
fi

if [ "$layer" = cpu ]; then "$repo/scripts/build-wheelhouse.sh" cpu; fi
for payload in "${payloads[@]}"; do
  [ -s "$payload" ] || { echo "build-testhost-layer: $payload missing (scripts/build-wheelhouse.sh)" >&2; exit 1; }
done
builder="sglang-fleet-$layer-layer-build"
log="$repo/.cache/$layer-layer-build.log"
docker rm -f "$builder" >/dev/null 2>&1 || true
trap 'docker rm -f "$builder" >/dev/null 2>&1 || true' EXIT
say "building the $layer test-host layer from $base (a few minutes; log: $log)"
# The base has no ENTRYPOINT: the command alone is replaced here, and set back at the commit.
docker run -d --name "$builder" "$base" sleep infinity >/dev/null
if $copy_in; then
  for payload in "${payloads[@]}"; do docker cp - "$builder:/opt" <"$payload"; done
fi
ANSIBLE_CONFIG="$repo/ansible.cfg" SGLANG_FLEET_REPO="$repo" "$repo/.venv/bin/ansible-playbook" \
  -i "$builder," -c community.docker.docker -e "@$settings" "$playbook" >"$log" 2>&1 \
  || { tail -n 40 "$log" >&2; exit 1; }
docker exec "$builder" rm -rf /root/.cache/pip
say "committing $image"
docker commit --change 'CMD ["/sbin/init"]' "$builder" "$image" >/dev/null
docker tag "$image" "sglang-fleet-testhost-$layer:latest"
say "$layer test-host layer ready: $image ($(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec))"
