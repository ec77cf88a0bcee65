"""The sglang-router command line the sglang_router role writes into its unit (docs/ROUTER.md).

    router_command({"host": "0.0.0.0", "port": 30000, "worker_urls": [...], ...},
                   python="/opt/sglang-router/bin/python",
                   launcher="/opt/sglang-router/bin/sglang-router-launch.py",
                   key_credential="api-key")
    -> {"flag_argv": [...], "argv": [...], "exec_start": "..."}

flag_argv: the router's flags as its own parser reads them (the role checks them with the
launcher's --check); argv: the whole command, the launcher reading the API key from the named
systemd credential (never a key on the command line); exec_start: argv quoted for systemd's
ExecStart=. Flags render as the servers' do (sglang_fleet.flags.to_argv): true is a bare
switch, false and null are left out, a list is several values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_fleet.flags import exec_start, normalize_key, to_argv


def router_command(
    flags: Mapping[str, Any], *, python: str, launcher: str, key_credential: str = ""
) -> dict[str, Any]:
    """The router's flag words, its whole command and the ExecStart= value."""
    if any(normalize_key(key) == "api_key" for key in flags):
        raise ValueError("the router's API key never goes on its command line: use a credential")
    flag_argv = to_argv(flags)
    argv = [python, launcher]
    if key_credential:
        argv += ["--api-key-credential", key_credential]
    argv += flag_argv
    return {"flag_argv": flag_argv, "argv": argv, "exec_start": exec_start(argv)}
