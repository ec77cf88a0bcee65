#!/usr/bin/env bash
# Debian packages with the dependencies a test host lacks, as .deb files in .cache/<folder>:
# what an air-gapped site ships instead of letting its hosts reach a mirror. The download runs
# in the test-host image, so apt resolves against exactly what the hosts have installed, and
# the mirror is the one in that image's apt sources. Does nothing when the folder is complete.
#   scripts/build-debs.sh <folder> <package>...
# make monitoring-debs: Prometheus, Alertmanager and the node exporter (the monitoring role's
# monitoring_deb_dir, molecule/monitoring); make staging-debs: rsync (molecule/staging); make
# driver-debs: python3-apt (molecule/upgrade).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 <folder under .cache> <package>..." >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
name=$1
shift
out="$repo/.cache/$name"
packages=("$@")
stamp="$out/.packages"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${packages[*]}" ]; then
  exit 0
fi
echo "==> downloading ${packages[*]} and their missing dependencies into .cache/$name"
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
docker run --rm -v "$out.tmp:/out" sglang-fleet-testhost:latest bash -euc "
  apt-get update -qq
  apt-get install -qq -y --no-install-recommends --download-only \
    -o Dir::Cache::archives=/var/cache/apt/archives ${packages[*]} >/dev/null
  cp /var/cache/apt/archives/*.deb /out/
  chown -R $(id -u):$(id -g) /out"
echo "${packages[*]}" > "$out.tmp/.packages"
rm -rf "$out" && mv "$out.tmp" "$out"
ls "$out" | wc -l | xargs printf "==> %s packages in .cache/$name\n"
