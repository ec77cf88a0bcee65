"""The smoke client's whole command on the host (roles/smoke_gate/tasks/run.yml), built on the
control node from the inventory's workload."""

from __future__ import annotations

from typing import Any

from sglang_fleet.smoke.gate import GateInputError

# The client reads the API key from stdin into its environment: never on its command line,
# where every user of the host sees it (ps). exec keeps timeout's exit status (124/137).
_KEY_FROM_STDIN = (
    'IFS= read -r SGLANG_API_KEY; [ -n "$SGLANG_API_KEY" ] && export SGLANG_API_KEY; exec "$0" "$@"'
)
# The client's flags the role sets itself, never from the workload.
_SET_BY_THE_ROLE = {"--url", "--json", "--timeout", "--api-key", "--help"}


def smoke_argv(
    workload: dict[str, Any],
    *,
    python: str,
    client: str,
    port: int,
    json_path: str,
    timeout: int,
) -> list[str]:
    """The smoke client's whole command on the host (roles/smoke_gate/tasks/run.yml): bounded by
    coreutils' timeout, the key read from stdin, the workload as the client's flags (a key with
    a null value is left out). A key the client does not take is refused, naming it."""
    from sglang_fleet.smoke.smoke_client.command_line import build_parser  # noqa: PLC0415 (the client is only read here)

    flags = {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and option not in _SET_BY_THE_ROLE
    }
    argv = [client, "--url", f"http://127.0.0.1:{port}", "--json", json_path,
            "--timeout", str(timeout)]  # fmt: skip
    for key, value in workload.items():
        if value is None:
            continue
        flag = "--" + str(key).replace("_", "-")
        if flag not in flags:
            allowed = ", ".join(sorted(f[2:].replace("-", "_") for f in flags))
            raise GateInputError(
                f"smoke_gate_workload.{key}: not a workload setting of the smoke client ({allowed})"
            )
        argv += [flag, str(value)]
    timeout_argv = ["timeout", "--kill-after=10", str(timeout)]
    return [*timeout_argv, "/bin/sh", "-c", _KEY_FROM_STDIN, python, *argv]
