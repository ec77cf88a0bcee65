"""The collection's controller-side Python, or an error that says how to install it.

The action and filter plugins decide in tested Python: the package sglang_fleet, which the
collection carries at its root beside its own pyproject.toml (docs/COLLECTION.md,
"Controller-side Python"). A plugin imports this file before it imports the package, so that a
controller without the package fails with the one command that installs it into the Python that
runs Ansible, instead of a bare ModuleNotFoundError.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from ansible.errors import AnsibleError

# The collection's root: plugins/plugin_utils/<this file> -> ../.. (an installed collection's
# ansible_collections/sglang_fleet/fleet, or a checkout).
COLLECTION_ROOT = Path(__file__).resolve().parents[2]


def install_command(python: str = sys.executable, root: Path = COLLECTION_ROOT) -> str:
    """The command that installs the package from the collection into `python`."""
    return f"{shlex.quote(python)} -m pip install {shlex.quote(str(root))}"


def missing_message(
    error: ImportError, python: str = sys.executable, root: Path = COLLECTION_ROOT
) -> str:
    """What a controller without the package is told: what is missing, and the command."""
    return (
        f"sglang_fleet.fleet needs its controller-side Python package sglang_fleet in the Python "
        f"that runs Ansible ({python}): {error}. The collection carries it; install it with\n"
        f"    {install_command(python, root)}\n"
        '(docs/COLLECTION.md, "Controller-side Python").'
    )


try:
    import sglang_fleet  # noqa: F401  (only whether it is there)
except ImportError as _error:
    raise AnsibleError(missing_message(_error)) from _error
