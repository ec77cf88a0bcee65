"""gpu_cleanup's gate: whether every needed GPU is clear (no process of any owner on it, used
memory at most the threshold), waiting for it, and resetting GPUs stuck with no process left.
Standard library only: it runs on GPU hosts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_discovery import (
    Snapshot,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.gpu_cleanup_plan import on_needed
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.timed_command import Runner


@dataclass
class GateResult:
    clear: bool
    remaining: list[dict[str, Any]]
    busy_gpus: list[int]
    stuck_gpus: list[int]
    gpus: list[dict[str, Any]]


def evaluate(snapshot: Snapshot, needed: set[int], max_used_mib: int) -> GateResult:
    """Is every needed GPU clear in this snapshot? Unknown memory counts as busy."""
    remaining = [p for p in snapshot.processes if not p.get("ignored") and on_needed(p, needed)]
    busy = sorted(
        g["index"]
        for g in snapshot.gpus
        if g["index"] in needed
        and (g["memory_used_mib"] is None or g["memory_used_mib"] > max_used_mib)
    )
    held = {g for p in remaining for g in p["gpus"]}
    any_held = any(p["any_gpu"] for p in remaining)
    stuck = [g for g in busy if g not in held and not any_held]
    clear = not remaining and not busy
    return GateResult(clear, remaining, busy, stuck, snapshot.gpus)


def wait_clear(
    snap: Callable[[], Snapshot],
    needed: set[int],
    max_used_mib: int,
    timeout: float,
    poll_interval: float,
) -> GateResult:
    deadline = time.monotonic() + timeout
    while True:
        result = evaluate(snap(), needed, max_used_mib)
        if result.clear or time.monotonic() >= deadline:
            return result
        time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))


def reset_gpus(gpus: list[int], nvidia_smi: str, runner: Runner) -> tuple[list[int], list[str]]:
    done, warnings = [], []
    for index in gpus:
        rc, out, err = runner([nvidia_smi, "-r", "-i", str(index)], 120)
        if rc == 0:
            done.append(index)
        else:
            warnings.append(f"nvidia-smi -r -i {index} exited {rc}: {(out + err).strip()[:300]}")
    return done, warnings
