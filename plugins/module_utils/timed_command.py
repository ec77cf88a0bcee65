"""Run a command on this host with a time bound.

The gpu_cleanup parts take the runner as an argument (nvidia-smi, systemctl), so tests hand
them a fake one. Standard library only: it runs on GPU hosts.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

Runner = Callable[[list[str], float], tuple[int, str, str]]


def run_command(argv: list[str], timeout: float) -> tuple[int, str, str]:
    """Run argv with a time bound; a missing binary is rc 127 like a shell would say."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        return 127, "", f"{argv[0]}: not found ({exc})"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv)}: no answer within {timeout:g} s"
    return done.returncode, done.stdout, done.stderr
