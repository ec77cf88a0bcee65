#!/usr/bin/env bash
# rsync with the dependencies a test host lacks, as .deb files in .cache/staging-debs: the
# staging scenario's hosts (molecule/staging) copy checkpoints with it, and an air-gapped site
# ships packages instead of letting its hosts reach a mirror. The download runs in the
# test-host image, so apt resolves against exactly what the hosts have installed, and the
# mirror is the one in that image's apt sources. Does nothing when the folder is complete.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/.cache/staging-debs"
packages=(rsync)
stamp="$out/.packages"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${packages[*]}" ]; then
  exit 0
fi
echo "==> downloading ${packages[*]} and their missing dependencies into .cache/staging-debs"
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
docker run --rm -v "$out.tmp:/out" sglang-fleet-testhost:latest bash -euc "
  apt-get update -qq
  apt-get install -qq -y --no-install-recommends --download-only \
    -o Dir::Cache::archives=/var/cache/apt/archives ${packages[*]} >/dev/null
  cp /var/cache/apt/archives/*.deb /out/
  chown -R $(id -u):$(id -g) /out"
echo "${packages[*]}" > "$out.tmp/.packages"
rm -rf "$out" && mv "$out.tmp" "$out"
ls "$out" | wc -l | xargs printf '==> %s packages in .cache/staging-debs\n'
