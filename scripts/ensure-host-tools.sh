#!/usr/bin/env bash
# Make sure this machine can run the Molecule test hosts: Debian's docker.io and debootstrap
# installed, and a Docker engine answering; and Debian's prometheus for promtool, which checks
# the monitoring role's rules and dashboard queries (tests/test_monitoring_rules.py). Where no
# service manager runs dockerd (a container or CI sandbox without systemd as PID 1), start it in
# the background and wait for its socket.
set -euo pipefail

say() { printf '==> %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || missing+=(debootstrap)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing Debian packages: ${missing[*]} (mirror from this machine's apt sources)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if docker info >/dev/null 2>&1; then
  say "Docker engine is answering"
  exit 0
fi

if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
  say "starting docker.service"
  as_root systemctl start docker
else
  log=/var/log/sglang-fleet-dockerd.log
  # A dockerd killed earlier (its session ended) leaves its pid file behind.
  pidfile=/var/run/docker.pid
  if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    as_root rm -f "$pidfile"
  fi
  say "no service manager runs dockerd here: starting it in the background (log: $log)"
  as_root bash -c "nohup dockerd >>'$log' 2>&1 </dev/null &"
fi

for _ in $(seq 1 60); do
  if docker info >/dev/null 2>&1; then
    say "Docker engine is answering"
    exit 0
  fi
  sleep 1
done
echo "ERROR: the Docker engine did not answer within 60 s; see ${log:-journalctl -u docker}" >&2
exit 1
