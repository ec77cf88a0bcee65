#!/usr/bin/env bash
# `make demo`: the main job on a local simulated GPU host. Starts a systemd test-host container
# (8 simulated 96 GB GPUs, 400 GiB RAM: the Kimi job's (docs/THE-JOB.md) host), makes it a GPU host with the GPU-less
# double, runs playbooks/site.yml against it exactly as against a real host, then asks the
# server for a generation. Rerunning it is a no-op rollout (changed=0).
set -euo pipefail
say() { printf '\n==> %s\n' "$*"; }
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
export ANSIBLE_CONFIG="$repo/ansible.cfg" SGLANG_FLEET_REPO="$repo"
host=sglang-fleet-demo

if [ "$(docker inspect -f '{{.State.Running}}' "$host" 2>/dev/null)" != true ]; then
  say "starting the simulated GPU host '$host' (a Debian 12 container booting systemd)"
  docker rm -f "$host" >/dev/null 2>&1 || true
  docker run -d --name "$host" --hostname "$host" --cgroupns host \
    -v /sys/fs/cgroup:/sys/fs/cgroup:rw --tmpfs /run --tmpfs /run/lock --tmpfs /tmp \
    sglang-fleet-testhost:latest /sbin/init >/dev/null
fi

say "installing the GPU-less double on it (test infrastructure: nvidia-smi + SGLang-compatible server)"
ansible-playbook -i inventory/demo molecule/shared/prepare.yml

say "ansible-playbook -i inventory/demo playbooks/site.yml  (provision, clean GPUs, deploy, gate)"
ansible-playbook -i inventory/demo playbooks/site.yml

say "the server answers a generation:"
docker exec "$host" python3 -c '
import json, urllib.request
body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16}}
req = urllib.request.Request("http://127.0.0.1:8000/generate", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=60))
print(json.dumps({"text": out["text"], "meta_info": out["meta_info"]}, indent=2))'
say "done. GPUs as the host sees them:"
docker exec "$host" nvidia-smi
echo "Stop the demo host with: docker rm -f $host"
