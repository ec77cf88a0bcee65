#!/usr/bin/env bash
# `make demo`: the main job on a local simulated GPU host. Starts a systemd test-host container
# (8 simulated 96 GB GPUs, 400 GiB RAM: the Kimi job's (docs/THE-JOB.md) host), makes it a GPU host with the GPU-less
# double, runs playbooks/site.yml against it exactly as against a real host, asks the server for
# a generation, and ends with a small job: 200 prompts through the server by playbooks/job.yml
# (the job runner as a systemd unit on the host), its progress shown while it runs. Rerunning it
# is a no-op rollout (changed=0), and the job, already done, is not run again.
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

job=demo
input="$repo/.cache/demo-job.jsonl"
say "a small job: 200 prompts through the server (playbooks/job.yml; docs/JOB.md)"
# SpecForge's rows ({id, conversations}): each user turn gets a regenerated assistant turn.
python3 - "$input" <<'PY'
import json, random, sys
words = ("the of and model server token batch prompt answer cache request fleet job row shard "
         "draft train speed queue memory").split()
rng = random.Random(45)
with open(sys.argv[1], "w", encoding="utf-8") as out:
    for number in range(200):
        prompt = " ".join(rng.choices(words, k=rng.randint(8, 40)))
        row = {"id": f"demo-{number:03d}", "conversations": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": prompt}]}
        out.write(json.dumps(row) + "\n")
PY
# The planner sizes the server at far more of these short rows at once than there are: 16 at a
# time keep the job long enough to watch (the play says both numbers).
ansible-playbook -i inventory/demo playbooks/job.yml -e sglang_job_name="$job" \
  -e sglang_job_action=start -e sglang_job_input="$input" -e sglang_job_max_tokens=64 \
  -e sglang_job_concurrency=16

say "its progress, as the job's own status says it (python3 -m sglang_fleet.job status):"
status=(docker exec "$host" /opt/sglang-job/bin/python /usr/local/lib/sglang-fleet/job.pyz status
        "/var/lib/sglang-job/$job/output/$job.jsonl")
for _ in $(seq 150); do
  line=$("${status[@]}")
  echo "$line"
  case "$line" in *": finished,"*|*"left 0)"*) break ;; esac
  sleep 2
done
ansible-playbook -i inventory/demo playbooks/job.yml -e sglang_job_name="$job" -e sglang_job_action=status

say "done. GPUs as the host sees them:"
docker exec "$host" nvidia-smi
echo "The job's rows: /var/lib/sglang-job/$job/output/ on $host (docker exec $host ls ...)."
echo "Stop the demo host with: docker rm -f $host"
