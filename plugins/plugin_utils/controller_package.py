"""The collection's controller-side Python, or an error that says how to install it.

The action and filter plugins decide in tested Python: the package sglang_fleet, which the
collection carries at its root beside its own pyproject.toml (docs/COLLECTION.md,
"Controller-side Python"). A plugin must still import without it (ansible-doc and ansible-test's
import test load every plugin in a Python that has no third-party package, on purpose), and fail
only when used, with the one command that installs the package into the Python that runs
Ansible. So each plugin imports the package inside `try`, keeps the ImportError, and hands it
here when used (the pattern of Ansible's developer guide and community.general):

    try:
        from sglang_fleet.x import y
    except ImportError as error:
        PACKAGE_ERROR: ImportError | None = error
    else:
        PACKAGE_ERROR = None

- an action's `run()` calls `require(PACKAGE_ERROR)` first;
- a FilterModule's `filters()` returns `filters({...}, PACKAGE_ERROR)`: every name, each one
  failing with the message when called, so a play that uses one gets the message, not an
  unknown filter.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleActionFail, AnsibleFilterError

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


def require(error: ImportError | None) -> None:
    """An action's first step: the task fails with the message when its plugin could not
    import the package."""
    if error is not None:
        raise AnsibleActionFail(missing_message(error)) from error


def filters(
    table: Mapping[str, Callable[..., Any]], error: ImportError | None
) -> dict[str, Callable[..., Any]]:
    """A FilterModule's filters: as given when its plugin imported the package; else the same
    names, each failing with the message when called."""
    if error is None:
        return dict(table)
    return {name: _missing(name, error) for name in table}


def _missing(name: str, error: ImportError) -> Callable[..., Any]:
    def missing(*_args: Any, **_kwargs: Any) -> Any:
        raise AnsibleFilterError(f"{name}: {missing_message(error)}") from error

    return missing
