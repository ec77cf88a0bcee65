"""Start sglang-router with its API key read from a systemd credential, never from argv.

sglang-router 0.3.2 takes an API key only as `--api-key KEY` on its command line (no environment
variable, no config file; docs/ROUTER.md), where the unit file, `systemctl show` and `ps` would
show it. This launcher takes the router's own flags, refuses `--api-key` among them, reads the
key from the file systemd hands the service (`LoadCredential=NAME:PATH`, found under
`$CREDENTIALS_DIRECTORY`) and starts the router in this process with the key set.

    python sglang-router-launch.py [--api-key-credential NAME] [--check] ROUTER-FLAGS...

`--check` parses the flags with the installed router's own parser, prints the settings that
matter to a deployment as JSON and exits without starting anything (exit 2 and argparse's
message for a bad flag). Run with the virtualenv's python that holds sglang-router.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from sglang_router.launch_router import launch_router, parse_router_args

# Settings printed by --check: what the deployment chose, never a secret.
CHECKED_FIELDS = (
    "host",
    "port",
    "worker_urls",
    "policy",
    "log_level",
    "prometheus_host",
    "prometheus_port",
    "health_check_endpoint",
    "health_check_interval_secs",
    "health_check_timeout_secs",
    "health_failure_threshold",
    "health_success_threshold",
    "retry_max_retries",
    "request_timeout_secs",
    "shutdown_grace_period_secs",
)


def fail(message: str, code: int = 1) -> NoReturn:
    print(f"sglang-router-launch: {message}", file=sys.stderr)
    sys.exit(code)


def split_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This launcher's own options, and the rest (the router's flags)."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    own.add_argument("--api-key-credential", default=None)
    own.add_argument("--check", action="store_true")
    return own.parse_known_args(argv)


def read_credential(name: str) -> str:
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        fail(
            f"--api-key-credential {name}: $CREDENTIALS_DIRECTORY is not set; run under systemd "
            f"with LoadCredential={name}:/path/to/key"
        )
    path = Path(directory) / name
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as err:
        fail(f"cannot read the API key credential {path}: {err.strerror}")
    if not key:
        fail(f"the API key credential {path} is empty")
    return key


def main(argv: list[str]) -> None:
    own, router_argv = split_argv(argv)
    args: Any = parse_router_args(router_argv)
    if args.api_key is not None:
        fail("refusing --api-key on the command line: pass --api-key-credential NAME instead", 2)
    if own.check:
        print(json.dumps({name: getattr(args, name, None) for name in CHECKED_FIELDS}))
        return
    if own.api_key_credential:
        args.api_key = read_credential(own.api_key_credential)
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
