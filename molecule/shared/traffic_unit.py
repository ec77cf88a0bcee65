"""Run traffic.py (beside this file) on a test host while a playbook runs.

    with TrafficUnit(host, "changed", unit="fleet-traffic", url="http://gw:8080", key=KEY) as t:
        run = run_playbook(...)
    result = t.result()

On entry the client is copied to the host and started as a transient systemd unit (so it
outlives the command that starts it and stops with the host); on exit it is told to stop by its
stop file and waited for. The key, when there is one, goes to a root-only file on the host,
never into the unit's command line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

CLIENT = Path(__file__).resolve().parent / "traffic.py"


class TrafficUnit:
    """traffic.py as the transient unit `unit` on a testinfra host, in /root/<unit>."""

    def __init__(
        self,
        host: Any,
        label: str,
        *,
        unit: str,
        url: str,
        key: str | None = None,
        threads: int = 4,
        tokens: int = 32,
    ) -> None:
        self.host, self.unit, self.url, self.key = host, unit, url, key
        self.threads, self.tokens = threads, tokens
        self.dir = f"/root/{unit}"
        self.out = f"{self.dir}/{label}.json"
        self.stop = f"{self.dir}/{label}.stop"

    def __enter__(self) -> TrafficUnit:
        host = self.host
        host.check_output("install -d -m 0700 %s", self.dir)
        result = host.ansible(
            "ansible.builtin.copy",
            f"src={CLIENT} dest={self.dir}/traffic.py mode=0644",
            check=False,
        )
        assert not result.get("failed"), result
        key_args = ""
        if self.key is not None:
            host.check_output(
                "printf '%%s\\n' %s > %s/key && chmod 600 %s/key", self.key, self.dir, self.dir
            )
            key_args = f" --key-file {self.dir}/key"
        host.check_output(
            "systemd-run --unit=%s --collect python3 %s/traffic.py --url %s --out %s"
            " --stop-file %s --threads %s --tokens %s --max-seconds 600" + key_args,
            self.unit,
            self.dir,
            self.url,
            self.out,
            self.stop,
            str(self.threads),  # testinfra shell-quotes every argument: strings only
            str(self.tokens),
        )
        time.sleep(3)  # a few requests before the playbook starts
        return self

    def __exit__(self, *exc: object) -> None:
        self.host.run("touch %s", self.stop)
        deadline = time.monotonic() + 90
        while self.host.run("systemctl is-active --quiet %s", self.unit).rc == 0:
            assert time.monotonic() < deadline, "the traffic client did not stop"
            time.sleep(1)

    def result(self) -> dict[str, Any]:
        """traffic.py's JSON document (its docstring says what it holds)."""
        return json.loads(self.host.check_output("cat %s", self.out))
