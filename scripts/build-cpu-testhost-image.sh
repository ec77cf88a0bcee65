#!/usr/bin/env bash
# Build the real-SGLang scenario's test-host image: the Molecule test host
# (scripts/build-test-image.sh) with the ml_env role already run over it in its CPU set
# (ml_env_accelerator: cpu, from .cache/cpu-wheelhouse), committed as a layer.
# Installing about 1 GB of wheels into a fresh container costs minutes on 2 cores; the scenario
# starts from this layer instead, and proves the provisioning by running ml_env over it again:
# that run must change nothing and its verify must find every pinned version
# (molecule/real_sglang/tests/test_real_sglang.py).
# Cached: the tag carries a hash of what decides the layer's content: the base image, the CPU
# wheelhouse and lock, the ml_env role's defaults and vars, the scenario's ml_env settings, this
# script. A change to the role's tasks alone does not rebuild it: the scenario's own ml_env run
# over the layer must still change nothing, which is what proves the layer is what the role
# makes (a stale layer fails there; removing the sglang-fleet-testhost-cpu images rebuilds it).
set -euo pipefail

say() { printf '==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
payload="$repo/.cache/testhost-cpu-payload.tar"
settings="$repo/molecule/real_sglang/inventory/group_vars/gpu_hosts/ml_env.yml"
playbook="$repo/molecule/real_sglang/ml_env_layer.yml"
base=sglang-fleet-testhost:latest
[ -s "$payload" ] || { echo "build-cpu-testhost-image: $payload missing (scripts/build-wheelhouse.sh cpu)" >&2; exit 1; }

# The base by its recipe tag (scripts/build-test-image.sh), not its id: a rebuild of the same
# recipe elsewhere on the machine must not invalidate this layer.
recipe_hash=$( { docker image inspect -f '{{join .RepoTags " "}}' "$base" | tr ' ' '\n' | grep -v ':latest$';
  cat "$0" "$settings" "$playbook";
  cat "$repo/.cache/cpu-wheelhouse/.downloads"; cat "$repo/gpusim/tools/sglang-0.5.23-cpu.lock";
  cat "$repo/roles/ml_env/defaults/main.yml" "$repo/roles/ml_env/vars/main.yml"; } | sha256sum | cut -c1-12)
image="sglang-fleet-testhost-cpu:$recipe_hash"
if docker image inspect "$image" >/dev/null 2>&1; then
  say "CPU test-host image $image is up to date"
  docker tag "$image" sglang-fleet-testhost-cpu:latest
  exit 0
fi

builder=sglang-fleet-cpu-layer-build
docker rm -f "$builder" >/dev/null 2>&1 || true
trap 'docker rm -f "$builder" >/dev/null 2>&1 || true' EXIT
say "installing SGLang's CPU set with the ml_env role into a $base container (a few minutes)"
# The base has no ENTRYPOINT: the command alone is replaced here, and set back at the commit.
docker run -d --name "$builder" "$base" sleep infinity >/dev/null
docker cp - "$builder:/opt" <"$payload"
ANSIBLE_CONFIG="$repo/ansible.cfg" SGLANG_FLEET_REPO="$repo" "$repo/.venv/bin/ansible-playbook" \
  -i "$builder," -c community.docker.docker -e "@$settings" "$playbook" \
  >"$repo/.cache/cpu-layer-build.log" 2>&1 \
  || { tail -n 40 "$repo/.cache/cpu-layer-build.log" >&2; exit 1; }
docker exec "$builder" rm -rf /root/.cache/pip
say "committing $image"
docker commit --change 'CMD ["/sbin/init"]' "$builder" "$image" >/dev/null
docker tag "$image" sglang-fleet-testhost-cpu:latest
say "CPU test-host image ready: $image ($(docker image inspect -f '{{.Size}}' "$image" | numfmt --to=iec))"
