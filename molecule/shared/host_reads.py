"""What the scenarios' verifiers read from a test host, once for all of them.

    from host_reads import healthy_workers, read_json, unit_identity
    before = unit_identity(host, "sglang@llama.service")

`host` is a testinfra host. Each read is a command on the host, never a guess from the
controller: a unit's identity from systemd, a JSON file as it is on disk, the router's workers
from the router itself (asked from the router's own host, with the key on stdin).
"""

from __future__ import annotations

import json
from typing import Any

from sglang_fleet.module_utils.router_workers import parse_workers


def unit_identity(host: Any, unit: str) -> tuple[str, str]:
    """MainPID and start timestamp: both unchanged means the server was not touched."""
    out = host.check_output("systemctl show -p MainPID -p ActiveEnterTimestampMonotonic %s", unit)
    props = dict(line.split("=", 1) for line in out.splitlines())
    return props["MainPID"], props["ActiveEnterTimestampMonotonic"]


def read_json(host: Any, path: str) -> Any:
    return json.loads(host.check_output("cat %s", path))


def router_workers(host: Any, key: str | None = None, port: int = 8080) -> list[dict[str, Any]]:
    """GET /workers of the router on `host` (from that host), with the key when it has one."""
    script = (
        "import json, sys, urllib.request;"
        "key = sys.stdin.read().strip();"
        f"r = urllib.request.Request('http://127.0.0.1:{int(port)}/workers',"
        " headers={'Authorization': 'Bearer ' + key} if key else {});"
        "print(urllib.request.urlopen(r, timeout=10).read().decode())"
    )
    out = host.run("printf %%s %s | python3 -c %s", key or "", script)
    assert out.rc == 0, out.stderr
    # The modules' own reader: a list of another shape fails the verifier, naming the router.
    return parse_workers(json.loads(out.stdout), f"the router on {host} (port {int(port)})")


def healthy_workers(host: Any, key: str | None = None, port: int = 8080) -> set[str]:
    """The URLs of the workers the router on `host` counts healthy now."""
    return {w["url"] for w in router_workers(host, key, port) if w["is_healthy"] is True}
