#!/usr/bin/env python3
"""What a rollout costs around its own work: a one-flag deploy on one simulated host (issue 31).

    .venv/bin/python bench/rollout_overhead.py             # converge, then 2 timed pairs
    .venv/bin/python bench/rollout_overhead.py --reps 3 --keep
    .venv/bin/python bench/rollout_overhead.py --reuse     # time again on a host left by --keep

The work of a one-flag rollout is the server's own start-to-ready and the smoke benchmark;
everything else is the rollout's bookkeeping. On the demo's host (one server: Kimi-K2.5 on
8 simulated GPUs, inventory/demo), each timed pair is:

- a one-flag deploy: `playbooks/deploy.yml` with `chunked_prefill_size` moved between 4096
  and 8192 (sglang_server_overrides), so every pair restarts the server once;
- a no-op rerun with the same variables (it must change nothing).

For each it reads Ansible's own per-task timings (the ansible.posix.json callback) and the
controller's CPU time (`os.wait4` on ansible-playbook: the process, its forked workers and
the `docker exec` processes they ran; what runs on the host is not counted), and prints the
medians and the ratios within this run:

- task headers (tasks Ansible ran or skipped, each once per play) of each kind of run;
- the health wait ("Wait for a real generation") and the smoke run (smoke_gate's "Benchmark
  <server>"): the work;
- around = wall - work, and around / work (issue 31's target: at most 1.5; issue 47's: at most 1.2);
- controller CPU-seconds of the deploy and of the no-op rerun.

Every timed deploy must exit 0 and the no-op rerun must change nothing, else the bench fails.
The times move with other load on the machine's cores: compare figures of one run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = "sglang-fleet-testhost:latest"
HOST = "sglang-fleet-bench-rollout"
SERVER = "kimi"
CHUNKS = (4096, 8192)
# Task names as the json callback reports them ("role : name - server"), and the field of each
# task's result that holds the work's own duration (the action times it on the controller).
HEALTH_TASK = ("sglang_server : Stop, clean, start and wait for a real generation", "health_s")
SMOKE_TASK = ("smoke_gate : Benchmark and gate ", "benchmark_s")


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


@dataclass(frozen=True)
class Run:
    """One timed ansible-playbook run."""

    wall_s: float
    cpu_s: float
    tasks: int
    changed: int
    health_s: float
    smoke_s: float
    names: tuple[str, ...] = ()

    @property
    def work_s(self) -> float:
        return self.health_s + self.smoke_s

    @property
    def around_s(self) -> float:
        return self.wall_s - self.work_s


def _inventory(folder: Path) -> Path:
    """inventory/demo's variables for this bench's own host."""
    inventory = folder / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        f"gpu_hosts:\n  hosts:\n    {HOST}:\n      ansible_connection: community.docker.docker\n"
    )
    shutil.copytree(REPO / "inventory" / "demo" / "group_vars", inventory / "group_vars")
    return inventory


def _start_host() -> None:
    subprocess.run(["docker", "rm", "-f", HOST], capture_output=True, check=False)
    subprocess.run(
        ["docker", "run", "-d", "--name", HOST, "--hostname", HOST, "--cgroupns", "host",
         "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw", "--tmpfs", "/run", "--tmpfs", "/run/lock",
         "--tmpfs", "/tmp", IMAGE, "/sbin/init"],
        check=True, capture_output=True,
    )  # fmt: skip


def _env(callback: str) -> dict[str, str]:
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "SGLANG_FLEET_REPO": str(REPO),
        "ANSIBLE_STDOUT_CALLBACK": callback,
        "ANSIBLE_NOCOLOR": "1",
    }


def _playbook(inventory: Path, playbook: str, extra: Path | None, callback: str) -> tuple:
    """(exit status, stdout, wall s, controller CPU s) of one ansible-playbook run."""
    cmd = [str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory), playbook]
    if extra is not None:
        cmd += ["-e", f"@{extra}"]
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(callback), stdout=out, stderr=out)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read().decode(errors="replace")
    return os.waitstatus_to_exitcode(status), text, wall, usage.ru_utime + usage.ru_stime


def _seconds(duration: dict) -> float:
    start, end = (datetime.datetime.fromisoformat(duration[k]) for k in ("start", "end"))
    return (end - start).total_seconds()


def _task_seconds(report: dict, which: tuple[str, str | None]) -> float:
    """The work's seconds: the result field that times it, else the whole task's duration."""
    prefix, field = which
    total = 0.0
    for play in report["plays"]:
        for task in play["tasks"]:
            if not task["task"]["name"].startswith(prefix):
                continue
            timed = [res.get(field) for res in task["hosts"].values()] if field else []
            if timed and all(isinstance(value, int | float) for value in timed):
                total += sum(timed)
            else:
                total += _seconds(task["task"]["duration"])
    return total


def timed(inventory: Path, extra: Path) -> Run:
    rc, text, wall, cpu = _playbook(inventory, "playbooks/deploy.yml", extra, "ansible.posix.json")
    start = re.search(r"^\{", text, re.MULTILINE)
    if start is None:
        sys.exit(f"deploy.yml printed no JSON report (exit {rc}):\n{text[-4000:]}")
    if start.start():
        say(f"deploy.yml printed before its report: {text[: start.start()].strip()[:2000]}")
    report = json.loads(text[start.start() :])
    if rc != 0:
        sys.exit(f"deploy.yml exited {rc}: {json.dumps(report.get('stats'))}")
    return Run(
        wall_s=wall,
        cpu_s=cpu,
        tasks=sum(len(play["tasks"]) for play in report["plays"]),
        changed=sum(host.get("changed", 0) for host in report["stats"].values()),
        health_s=_task_seconds(report, HEALTH_TASK),
        smoke_s=_task_seconds(report, SMOKE_TASK),
        names=tuple(
            f"{_seconds(task['task']['duration']):6.2f} s  {task['task']['name']}"
            for play in report["plays"]
            for task in play["tasks"]
        ),
    )


def _median(runs: list[Run], name: str) -> float:
    return statistics.median(getattr(run, name) for run in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="timed deploy + rerun pairs")
    parser.add_argument("--keep", action="store_true", help="leave the host running")
    parser.add_argument("--reuse", action="store_true", help="time on a host left by --keep")
    parser.add_argument(
        "--offset", type=int, default=0, help="start at the other chunk size (after an odd --reps)"
    )
    parser.add_argument(
        "--list-tasks", action="store_true", help="print the last deploy's task headers"
    )
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="rollout-overhead-"))
    inventory = _inventory(folder)
    try:
        if not args.reuse:
            say(f"starting the simulated GPU host {HOST} and converging it (site.yml)")
            _start_host()
            for playbook in ("molecule/shared/prepare.yml", "playbooks/site.yml"):
                rc, text, wall, _ = _playbook(inventory, playbook, None, "default")
                if rc != 0:
                    sys.exit(f"{playbook} exited {rc}:\n{text[-4000:]}")
                say(f"{playbook}: {wall:.0f} s")
        deploys, reruns = [], []
        for rep in range(args.reps):
            chunk = CHUNKS[(rep + args.offset) % 2]
            extra = folder / f"chunk-{chunk}.json"
            overrides = {SERVER: {"flags": {"chunked_prefill_size": chunk}}}
            extra.write_text(json.dumps({"sglang_server_overrides": overrides}))
            deploy, rerun = timed(inventory, extra), timed(inventory, extra)
            if deploy.changed == 0 or deploy.health_s == 0 or deploy.smoke_s == 0:
                sys.exit(f"the deploy to chunked_prefill_size {chunk} restarted nothing: {deploy}")
            if rerun.changed:
                sys.exit(f"the no-op rerun changed {rerun.changed} task(s)")
            deploys.append(deploy)
            reruns.append(rerun)
            say(
                f"pair {rep + 1}: deploy {deploy.wall_s:.1f} s ({deploy.tasks} tasks, "
                f"{deploy.cpu_s:.1f} CPU-s; health wait {deploy.health_s:.1f} s, smoke "
                f"{deploy.smoke_s:.1f} s), no-op rerun {rerun.wall_s:.1f} s ({rerun.tasks} tasks)"
            )
    finally:
        if not args.keep:
            subprocess.run(["docker", "rm", "-f", HOST], capture_output=True, check=False)
        shutil.rmtree(folder, ignore_errors=True)
    if args.list_tasks:
        print("\n".join(deploys[-1].names))
    work, around = _median(deploys, "work_s"), _median(deploys, "around_s")
    print(
        f"\none-flag deploy, median of {args.reps}: {_median(deploys, 'wall_s'):.1f} s wall, "
        f"{_median(deploys, 'tasks'):.0f} task headers, {_median(deploys, 'cpu_s'):.1f} "
        "controller CPU-s\n"
        f"  work: health wait {_median(deploys, 'health_s'):.1f} s + smoke run "
        f"{_median(deploys, 'smoke_s'):.1f} s = {work:.1f} s\n"
        f"  around the work: {around:.1f} s = {around / work:.2f} x the work (target <= 1.2)\n"
        f"no-op rerun: {_median(reruns, 'wall_s'):.1f} s wall, {_median(reruns, 'tasks'):.0f} "
        f"task headers, {_median(reruns, 'cpu_s'):.1f} controller CPU-s "
        f"({_median(reruns, 'wall_s') / _median(deploys, 'wall_s'):.2f} x the deploy's wall)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
