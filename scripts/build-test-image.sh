#!/usr/bin/env bash
# Build the Molecule test-host image: a minimal Debian 12 rootfs from debootstrap that boots
# systemd as PID 1 and runs sshd, imported with `docker import` (no registry is reachable).
# Cached: the image tag carries a hash of this recipe and of the CA certificates copied in, so
# the build reruns only when one of them changes.
# SSH: the image holds no key. Each checkout has its own (.cache/testhost/id_ed25519, made here
# when missing); what reaches a host over SSH (molecule/provision, bench/fleet_noop.py) mounts
# its public half as root's authorized_keys, so checkouts that share this machine's Docker
# images cannot lock each other out.
# Env: TESTHOST_MIRROR overrides the Debian mirror (default: this machine's apt sources).
set -euo pipefail

say() { printf '==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
cache="$repo/.cache/testhost"
mkdir -p "$cache"
packages=systemd,systemd-sysv,dbus,python3,python3-venv,openssh-server,ca-certificates,procps,iproute2,psmisc,sudo,kmod,gnupg
extra_certs=(/usr/local/share/ca-certificates/*.crt)
[ -e "${extra_certs[0]}" ] || extra_certs=()

recipe_hash=$( { cat "$0"; echo "$packages"; for c in "${extra_certs[@]}"; do cat "$c"; done; } \
  | sha256sum | cut -c1-12)
image="sglang-fleet-testhost:$recipe_hash"
key="$cache/id_ed25519"

if [ ! -s "$key" ] || [ ! -s "$key.pub" ]; then
  rm -f "$key" "$key.pub"
  ssh-keygen -q -t ed25519 -N '' -C sglang-fleet-molecule -f "$key"
fi

if docker image inspect "$image" >/dev/null 2>&1; then
  say "test-host image $image is up to date"
  docker tag "$image" sglang-fleet-testhost:latest
  exit 0
fi

mirror_from_apt_sources() {
  # deb822 (*.sources): first URIs of a stanza whose Suites name bookworm (not -security);
  # one-line form: first `deb URL bookworm ...`.
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm( |\n|$)/ && !/security/ {
           if (match($0, /URIs:[ \t]*[^ \t\n]+/)) { s=substr($0,RSTART,RLENGTH); sub(/URIs:[ \t]*/,"",s); print s; exit } }' "$f"
  done
  grep -hE '^deb +(\[[^]]*\] +)?[a-z]+://[^ ]+ +bookworm ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | sed -E 's/^deb +(\[[^]]*\] +)?//' | awk '{print $1}' || true
}
mirror=${TESTHOST_MIRROR:-$(mirror_from_apt_sources | head -n 1 || true)}
if [ -z "$mirror" ]; then
  echo "ERROR: no Debian bookworm mirror found in /etc/apt/sources*; set TESTHOST_MIRROR" >&2
  exit 1
fi

rootfs=$(mktemp -d /tmp/sglang-fleet-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
say "debootstrap bookworm from this machine's apt mirror (takes a few minutes)"
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror" \
  >"$cache/debootstrap.log" 2>&1 || { tail -n 30 "$cache/debootstrap.log" >&2; exit 1; }

say "configuring the rootfs: CA certificates, sshd for keys only, systemd for containers"
for c in "${extra_certs[@]}"; do cp "$c" "$rootfs/usr/local/share/ca-certificates/"; done
chroot "$rootfs" update-ca-certificates >/dev/null
install -d -m 0700 "$rootfs/root/.ssh"
chroot "$rootfs" ssh-keygen -A >/dev/null
printf 'PermitRootLogin prohibit-password\nPasswordAuthentication no\n' \
  >"$rootfs/etc/ssh/sshd_config.d/molecule.conf"
: >"$rootfs/etc/machine-id"
# Units that have nothing to do in a container and only slow the boot down.
for unit in getty@tty1.service serial-getty@.service systemd-udevd.service \
            systemd-udev-trigger.service systemd-modules-load.service \
            systemd-remount-fs.service sys-kernel-config.mount apt-daily.timer \
            apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
chroot "$rootfs" systemctl enable ssh >/dev/null 2>&1
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/*

say "importing $image"
tar -C "$rootfs" -c . | docker import \
  --change 'CMD ["/sbin/init"]' --change 'ENV container=docker' \
  - "$image" >/dev/null
docker tag "$image" sglang-fleet-testhost:latest
say "test-host image ready: $image"
