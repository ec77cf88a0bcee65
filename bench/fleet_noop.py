#!/usr/bin/env python3
"""A no-op rerun of deploy.yml on 8 simulated hosts against the same rerun on 1 (issue 14).

    .venv/bin/python bench/fleet_noop.py                   # 8 hosts, 3 timed runs of each
    .venv/bin/python bench/fleet_noop.py --keep            # leave the hosts running afterwards
    .venv/bin/python bench/fleet_noop.py --reuse --reps 5  # time again on hosts left by --keep

Target: the rerun on 8 hosts takes at most 1.5 x the rerun on 1 host. deploy.yml checks every
host at once (forks) and sends only the hosts that would change into the serial rollout plays,
so on a converged fleet no host waits in a batch.

How it measures: it starts N test-host containers (the Molecule image: Debian 12 booting
systemd) on a Docker network of their own, makes them simulated GPU hosts
(molecule/shared/prepare.yml), deploys once with molecule/shared/converge.yml (the ml-env,
then deploy.yml: two servers per host, gated, as in the Molecule scenarios), then times
`ansible-playbook playbooks/deploy.yml` on the converged hosts, alternating `--limit` one host
and all N, and prints the median of each and their ratio. Every timed run must exit 0 and
change nothing (the recap's changed=0 on every host), else the bench fails. Ansible reaches the
hosts over SSH with pipelining and a persistent connection per host, as it reaches a real
fleet (sshd in the image, this checkout's .cache/testhost key mounted as root's
authorized_keys); --connection docker uses `docker exec` instead, which costs far more CPU per
task on this machine.

The times move with the load other processes put on the machine's cores: compare the two
figures of one run, never across runs. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = "sglang-fleet-testhost:latest"
NETWORK = "sglang-fleet-bench"
PREFIX = "fleet-bench-"
KEY = REPO / ".cache" / "testhost" / "id_ed25519"
SHARED = REPO / "molecule" / "shared"
TARGET_RATIO = 1.5
RECAP_RE = re.compile(
    r"^(\S+)\s+:\s+ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M
)


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def docker(*args: str, check: bool = True) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        sys.exit(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def host_names(count: int) -> list[str]:
    return [f"{PREFIX}{i}" for i in range(1, count + 1)]


def start_hosts(names: list[str]) -> None:
    docker("network", "create", NETWORK, check=False)
    for name in names:
        docker("rm", "-f", name, check=False)
        docker(
            "run", "-d", "--name", name, "--hostname", name, "--network", NETWORK,
            "--cgroupns", "host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw",
            "-v", f"{KEY}.pub:/root/.ssh/authorized_keys:ro",
            "--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp", IMAGE, "/sbin/init",
        )  # fmt: skip


def remove_hosts(names: list[str]) -> None:
    for name in names:
        docker("rm", "-f", name, check=False)
    docker("network", "rm", NETWORK, check=False)


def address(name: str) -> str:
    return docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", name)


def write_inventory(directory: Path, names: list[str], connection: str) -> Path:
    """gpu_hosts = the containers; group_vars = the Molecule scenarios' shared ones."""
    lines = ["gpu_hosts:", "  hosts:"]
    for name in names:
        if connection == "ssh":
            lines.append(f"    {name}: {{ansible_host: {address(name)}}}")
        else:
            lines.append(f"    {name}: {{ansible_connection: community.docker.docker}}")
    lines += ["  vars:", "    ansible_python_interpreter: /usr/bin/python3"]
    if connection == "ssh":
        lines += [
            "    ansible_user: root",
            f"    ansible_ssh_private_key_file: {KEY}",
            "    ansible_ssh_common_args: >-",
            "      -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
        ]
    (directory / "hosts.yml").write_text("\n".join(lines) + "\n")
    (directory / "group_vars").symlink_to(SHARED / "inventory" / "group_vars")
    return directory


def playbook(inventory: Path, path: Path, *extra: str) -> tuple[int, str, float]:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_PIPELINING": "true",
        "ANSIBLE_FORCE_COLOR": "false",
        "SGLANG_FLEET_REPO": str(REPO),
    }
    ansible = Path(sys.executable).with_name("ansible-playbook")
    start = time.monotonic()
    done = subprocess.run(
        [str(ansible), "-i", str(inventory), str(path), *extra],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def setup(inventory: Path, names: list[str]) -> None:
    for step, path in (
        ("prepare (the GPU-less double)", SHARED / "prepare.yml"),
        ("first deploy (ml-env, then deploy.yml)", SHARED / "converge.yml"),
    ):
        say(f"{step} on {len(names)} hosts")
        rc, out, took = playbook(inventory, path)
        if rc != 0:
            print(out[-6000:])
            sys.exit(f"{step} failed (rc {rc})")
        say(f"  took {took:.0f} s")


def no_op(inventory: Path, limit: str, expected_hosts: int) -> float:
    rc, out, took = playbook(inventory, REPO / "playbooks" / "deploy.yml", "--limit", limit)
    recap = RECAP_RE.findall(out)
    hosts = {host for host, *_ in recap if host != "localhost"}
    changed = {host: int(c) for host, c, _, _ in recap if int(c)}
    if rc != 0 or len(hosts) != expected_hosts or changed:
        print(out[-6000:])
        sys.exit(
            f"the rerun on {limit} was not a no-op: rc {rc}, hosts {sorted(hosts)}, "
            f"changed {changed}"
        )
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--connection", choices=("ssh", "docker"), default="ssh")
    parser.add_argument("--keep", action="store_true", help="leave the hosts running")
    parser.add_argument("--reuse", action="store_true", help="time hosts a --keep run left")
    args = parser.parse_args()
    if shutil.which("docker") is None:
        sys.exit("docker is not installed (make host)")
    if args.connection == "ssh" and not Path(f"{KEY}.pub").is_file():
        # docker would mount a new empty folder there and every host would refuse the key.
        sys.exit(f"no test-host key at {KEY}.pub: make image (scripts/build-test-image.sh)")
    names = host_names(args.hosts)
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        if args.reuse:
            docker("start", *names)  # a no-op for running ones; stopped ones boot their units
        else:
            say(f"starting {args.hosts} simulated GPU hosts ({IMAGE})")
            start_hosts(names)
        inventory = write_inventory(Path(tmp), names, args.connection)
        try:
            if not args.reuse:
                setup(inventory, names)
            # Not timed: settles anything left to do (servers of hosts that were stopped).
            say("warming up: one rerun on every host")
            rc, out, _ = playbook(inventory, REPO / "playbooks" / "deploy.yml")
            if rc != 0:
                print(out[-6000:])
                sys.exit(f"the warm-up rerun failed (rc {rc})")
            one, fleet = [], []
            for rep in range(1, args.reps + 1):
                one.append(no_op(inventory, names[0], 1))
                fleet.append(no_op(inventory, "gpu_hosts", len(names)))
                say(f"  run {rep}: 1 host {one[-1]:.1f} s, {len(names)} hosts {fleet[-1]:.1f} s")
        finally:
            if not args.keep:
                say("removing the hosts")
                remove_hosts(names)
    t1, tn = statistics.median(one), statistics.median(fleet)
    ratio = tn / t1
    print(f"no-op rerun of deploy.yml, median of {args.reps} ({args.connection} connection):")
    print(f"  1 host:  {t1:.1f} s  (runs: {', '.join(f'{t:.1f}' for t in one)})")
    print(f"  {len(names)} hosts: {tn:.1f} s  (runs: {', '.join(f'{t:.1f}' for t in fleet)})")
    verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
    print(f"  ratio:   {ratio:.2f} (target <= {TARGET_RATIO}: {verdict})")
    sys.exit(0 if ratio <= TARGET_RATIO else 1)


if __name__ == "__main__":
    main()
