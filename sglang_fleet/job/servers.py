"""The servers a job sends to, and which one takes the next call (docs/JOB.md, "Dispatch").

Each server (a replica's URL, or a router's standing for all its replicas) has a capacity: the
requests it holds at once, which the playbook sizes from the capacity planner's
max_concurrent_requests for the job's lengths. The next call goes to the server in service with
the fewest calls in flight for its capacity (least outstanding), and waits while every one is
full. A server whose calls keep failing as a server's do (no connection, closed mid-answer, no
answer in time) is taken out of service; a probe of its health endpoint every few seconds puts
it back. With every server out the job waits: it slows, it does not stop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_fleet.job.calls import OK, SERVER_FAULTS
from sglang_fleet.smoke.smoke_client.http_client import HttpClient

# Calls failed as a server's in a row before it is taken out; one success resets the count.
TAKE_OUT_AFTER = 3
PROBE_EVERY_S = 2.0


@dataclass
class Server:
    url: str
    capacity: int
    client: HttpClient
    in_flight: int = 0
    in_service: bool = True
    failed_in_a_row: int = 0
    calls: int = 0
    taken_out: int = 0
    out_since: float | None = None
    last_problem: str = ""

    def room(self) -> bool:
        return self.in_service and self.in_flight < self.capacity

    def load(self) -> float:
        return self.in_flight / self.capacity


@dataclass
class Pool:
    servers: list[Server]
    health_path: str = "/health"
    clock: Callable[[], float] = time.monotonic
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def capacity(self) -> int:
        """Calls the servers in service hold at once (at least 1: a job waits, never ends)."""
        return max(1, sum(s.capacity for s in self.servers if s.in_service))

    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    async def acquire(self) -> Server:
        """The least loaded server in service with room, waiting until there is one."""
        async with self._changed:
            while True:
                ready = [s for s in self.servers if s.room()]
                if ready:
                    server = min(ready, key=Server.load)
                    server.in_flight += 1
                    server.calls += 1
                    return server
                await self._changed.wait()

    async def release(self, server: Server, kind: str, problem: str = "") -> None:
        """A call ended; its class counts for or against the server."""
        async with self._changed:
            server.in_flight -= 1
            if kind in SERVER_FAULTS:
                server.failed_in_a_row += 1
                server.last_problem = problem
                if server.in_service and server.failed_in_a_row >= TAKE_OUT_AFTER:
                    server.in_service = False
                    server.taken_out += 1
                    server.out_since = self.clock()
            elif kind == OK:
                server.failed_in_a_row = 0
            self._changed.notify_all()

    async def probe_forever(self) -> None:
        """Put back every server that was taken out once its health endpoint answers 200."""
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            for server in [s for s in self.servers if not s.in_service]:
                try:
                    status, _body = await server.client.get(self.health_path)
                except OSError as exc:
                    server.last_problem = f"health probe: {exc}"
                    continue
                if status == 200:
                    async with self._changed:
                        server.in_service, server.failed_in_a_row = True, 0
                        server.out_since = None
                        self._changed.notify_all()

    def close(self) -> None:
        for server in self.servers:
            server.client.close()
