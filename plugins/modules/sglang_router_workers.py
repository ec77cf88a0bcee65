#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module: list, add or remove a worker of sglang-router through the router's own API."""

from __future__ import annotations

DOCUMENTATION = r"""
module: sglang_router_workers
short_description: List, add or remove a worker of sglang-router (the SGLang model gateway)
description:
  - Talks to the worker API of sglang-router 0.3.2 (C(GET/POST /workers), C(DELETE
    /workers/{id})); see docs/ROUTER.md for the facts it relies on. The router queues additions
    and removals and answers 202 at once, so the module waits until the router's list shows the
    result.
  - C(state=absent) can then wait until the removed replica has finished the requests it was
    running (C(drain_metrics_url), the replica's Prometheus C(/metrics)), bounded by
    C(drain_timeout).
  - Removing a worker fails, before anything is removed, when fewer than C(min_healthy_others)
    other healthy workers would be left to serve.
  - Check mode reports what would change without adding, removing or draining.
  - Every request goes through plugins/module_utils/fleet_http.py, bounded as a whole by
    C(request_timeout), its answer capped in size, redirects never followed (the key never
    goes to another host); URLs with C(user:password@) are refused and never printed.
  - The router's worker list is used only when every entry is understood, as
    plugins/module_utils/router_workers.py reads it (an C(id), a C(url) and an C(is_healthy) of true
    or false); a list of another shape fails the task naming the router, before anything is
    added, removed or drained.
options:
  router_url:
    description:
      - Base URL of the router (scheme, host, port), for example C(http://127.0.0.1:30000); no
        path, query or fragment.
    type: str
    required: true
  api_key:
    description:
      - The router's API key (its C(--api-key)); sent as C(Authorization Bearer). The worker API
        answers 401 without it when the router has a key.
    type: str
  state:
    description:
      - C(present) adds the worker unless the router lists it, then waits until it is healthy.
      - C(absent) removes it if listed, waits until the list no longer shows it, then drains.
      - C(list) only reads the router's workers.
    type: str
    choices: [present, absent, list]
    default: present
  worker_url:
    description:
      - The worker's URL exactly as the router lists it, C(http://host:port) without a path or a
        trailing slash (the router does not normalise URLs; C(http://host:port/) never becomes
        healthy).
      - Required unless C(state=list).
    type: str
  worker_api_key:
    description:
      - Key the router sends to the worker (C(api_key) of the registration). Workers the router
        started with inherit its own key, dynamically added ones do not, so this defaults to
        C(api_key). Give an empty string to register the worker without a key.
    type: str
  wait:
    description: Wait for the router to finish the addition or removal.
    type: bool
    default: true
  timeout:
    description: Seconds to wait for the addition (registered and healthy) or the removal.
    type: float
    default: 120
  min_healthy_others:
    description:
      - With C(state=absent), the least number of other healthy workers that must stay in the
        router. Set 0 to allow taking out the last one (a single-replica fleet).
    type: int
    default: 1
  drain_metrics_url:
    description:
      - With C(state=absent), the removed replica's C(/metrics) URL (the server needs
        C(--enable-metrics)). The module waits until C(sglang:num_running_reqs) plus
        C(sglang:num_queue_reqs), summed over all label sets, reads 0 twice in a row.
    type: str
  drain_timeout:
    description:
      - Seconds to wait for the drain. When it passes, the module does not fail; it returns
        C(drained=false) with the last counts and warns (SGLang's own SIGTERM drain, bounded by
        the unit's TimeoutStopSec, takes over).
    type: float
    default: 600
  poll_interval:
    description: Seconds between polls of the router and of the metrics.
    type: float
    default: 1
  request_timeout:
    description: Seconds one HTTP request may take, all of it (connect, headers and body).
    type: float
    default: 10
author: sglang-fleet maintainers (@sglang-fleet)
"""

EXAMPLES = r"""
- name: Take replica 1 out of the router and wait for its running requests
  sglang_fleet.fleet.sglang_router_workers:
    router_url: http://127.0.0.1:30000
    api_key: "{{ sglang_router_api_key }}"
    worker_url: http://10.0.0.11:8000
    state: absent
    drain_metrics_url: http://10.0.0.11:8000/metrics
    drain_timeout: 300

- name: Put it back after its gate passed
  sglang_fleet.fleet.sglang_router_workers:
    router_url: http://127.0.0.1:30000
    api_key: "{{ sglang_router_api_key }}"
    worker_url: http://10.0.0.11:8000
    state: present

- name: Read the router's workers
  sglang_fleet.fleet.sglang_router_workers:
    router_url: http://127.0.0.1:30000
    api_key: "{{ sglang_router_api_key }}"
    state: list
  register: router_workers
"""

RETURN = r"""
workers:
  description: The router's workers after the action, each {id, url, is_healthy, load, model_id}.
  type: list
  returned: always
worker:
  description: The entry of worker_url in that list, or null when the router does not list it.
  type: dict
  returned: unless state is list
drained:
  description: Whether the replica reached 0 running and queued requests within drain_timeout
    (null when no drain was asked for, or in check mode).
  type: bool
  returned: when state is absent
running_reqs:
  description: Running plus queued requests of the replica at the last metrics read.
  type: float
  returned: when a drain ran
drain_seconds:
  description: Seconds the drain took (or waited before giving up).
  type: float
  returned: when a drain ran
"""

import json
import math
import re
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.fleet_http import (
    HttpError,
    Response,
    check_url,
    redact_url,
    request,
    without_secrets,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.router_workers import (
    parse_workers,
    url_key,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.typed_number import (
    NumberError,
    Range,
    read,
)

DRAIN_METRICS = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
# Used with fullmatch: scheme, host and port, nothing after them (a `$` would let a newline by).
_WORKER_URL_RE = re.compile(r"(?i)https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?")
_ROUTER_URL_RE = re.compile(r"(?i)https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?/?")
# One Prometheus sample line: name, optional labels (quoted values may hold any character), value.
_SAMPLE_RE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')
_LISTED_FIELDS = ("id", "url", "is_healthy", "load", "model_id")
# The module's numbers, each bounded so that no wait is endless and no sleep is negative.
_DAY_S = 86400.0
NUMBERS = {
    "timeout": Range(0, _DAY_S, low_open=True),
    "drain_timeout": Range(0, _DAY_S),
    "poll_interval": Range(0, 3600, low_open=True),
    "request_timeout": Range(0, 3600, low_open=True),
    "min_healthy_others": Range(0, 4096, integer=True),
}
_MAX_JOB_TEXT = 300
# Two zero readings in a row: one could fall between a request leaving the router and the
# replica's scheduler admitting it.
_ZERO_READINGS = 2
_MAX_ANSWER_BYTES = 16 << 20


class RouterError(Exception):
    """A failure to report to the operator as is."""


@dataclass
class Clock:
    """Time functions, injected so tests can run the polling loops without real waits."""

    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


# Scheme and host in lower case; the router compares the rest as written.
normalize_url = url_key


def check_worker_url(url: str) -> str | None:
    """Why a worker URL cannot work with the router, or None."""
    if _WORKER_URL_RE.fullmatch(url):
        try:
            check_url(url, "worker_url")
        except HttpError as err:
            return str(err)
        return None
    url = redact_url(url)
    return (
        f"worker_url {url!r} must be http(s)://host[:port] with no path and no trailing slash "
        "(sglang-router 0.3.2 does not normalise URLs: 'http://host:port/' never gets healthy)"
    )


@dataclass
class RouterClient:
    """The worker API of sglang-router (docs/ROUTER.md, "Worker API")."""

    base_url: str
    api_key: str | None = None
    timeout: float = 10.0
    send: Callable[..., Response] = field(default=request)
    # Keys no message may quote, escaped or not (the router's answers may echo a worker's key):
    # the router's own and the one registered with the worker.
    hidden: tuple[str | None, ...] = ()

    def safe(self, text: object) -> str:
        """Text with every key this client knows of replaced, before any cut."""
        return without_secrets(text, (self.api_key, *self.hidden))

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return _decode(self._exchange(method, path, body))

    def _exchange(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        """The body of a 2xx answer; RouterError for anything else."""
        url = self.base_url.rstrip("/") + path
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            answer = self.send(
                url,
                method=method,
                headers=headers,
                body=data,
                deadline_s=self.timeout,
                max_bytes=_MAX_ANSWER_BYTES,
            )
        except HttpError as err:
            if err.code == "unreachable":
                raise RouterError(
                    f"cannot reach the router at {redact_url(url)}: {err.reason}"
                ) from None
            raise RouterError(f"the router at {redact_url(self.base_url)}: {err}") from None
        if answer.status >= 400:
            raise RouterError(_http_error_message(method, url, answer, self.safe))
        return answer.body

    def list_workers(self) -> list[dict[str, Any]]:
        """Every worker the router lists, each understood (plugins/module_utils/router_workers.py),
        or
        RouterError naming the router: nothing is decided on a list read in part."""
        where = f"GET {redact_url(self.base_url.rstrip('/'))}/workers"
        raw = self._exchange("GET", "/workers")
        try:
            return parse_workers(bounded_loads(raw, where), where)
        except ValueError as err:  # not JSON, too deep, or not a worker list
            raise RouterError(
                f"{self.safe(err)}: not a worker list this module understands"
            ) from None

    def add_worker(self, url: str, worker_api_key: str | None) -> str | None:
        """Queue the addition; the id of the router's registration job, when it gave one."""
        body: dict[str, Any] = {"url": url}
        if worker_api_key:
            body["api_key"] = worker_api_key
        job_id = _as_dict(self._request("POST", "/workers", body)).get("worker_id")
        return job_id if isinstance(job_id, str) and 0 < len(job_id) <= 256 else None

    def remove_worker(self, worker_id: str) -> dict[str, Any]:
        return _as_dict(self._request("DELETE", _worker_path(worker_id)))

    def get_worker(self, worker_id: str) -> dict[str, Any]:
        return _as_dict(self._request("GET", _worker_path(worker_id)))


def _worker_path(worker_id: str) -> str:
    """/workers/{id}, the id one path segment whatever it holds (a `/` or `..` included)."""
    return f"/workers/{urllib.parse.quote(worker_id, safe='')}"


def _decode(raw: bytes) -> Any:
    """An answer that only a message is taken from (JSON, else its text)."""
    text = raw.decode("utf-8", errors="replace")
    try:
        return bounded_loads(text, "the router's answer") if text.strip() else {}
    except ValueError:
        return text


def _as_dict(answer: Any) -> dict[str, Any]:
    return answer if isinstance(answer, dict) else {"message": answer}


def _http_error_message(
    method: str, url: str, answer: Response, safe: Callable[[object], str]
) -> str:
    detail = safe(answer.body.decode("utf-8", errors="replace")).strip()[:300]
    url = redact_url(url)
    if answer.status == 401:
        return (
            f"{method} {url}: the router answered 401 (unauthorized): set api_key to the "
            "router's --api-key"
        )
    return f"{method} {url}: the router answered {answer.status}: {detail or answer.reason}"


def find_worker(workers: list[dict[str, Any]], url: str) -> dict[str, Any] | None:
    """The worker listed under url (workers as list_workers gives them)."""
    wanted = url_key(url)
    for worker in workers:
        if url_key(worker["url"]) == wanted:
            return worker
    return None


def summarize(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: worker.get(key) for key in _LISTED_FIELDS} for worker in workers]


def healthy_others(workers: list[dict[str, Any]], url: str) -> int:
    wanted = url_key(url)
    return sum(1 for w in workers if w["is_healthy"] is True and url_key(w["url"]) != wanted)


def job_state(answer: Any, job_id: str) -> tuple[str, str]:
    """(status, message) of a registration job as GET /workers/{id} shows it; ("", "") when
    the answer has none (the worker is registered: the list says the rest). RouterError for a
    job_status of a shape the router does not give."""
    job = answer.get("job_status") if isinstance(answer, dict) else None
    if job is None:
        return "", ""
    status = job.get("status") if isinstance(job, dict) else None
    message = job.get("message") if isinstance(job, dict) else None
    if not isinstance(status, str) or not isinstance(message, (str, type(None))):
        raise RouterError(
            f"the router's registration job {job_id} has a job_status of an unknown shape: "
            "not {status: text, message: text or null}"
        )
    return status[:_MAX_JOB_TEXT], (message or "")[:_MAX_JOB_TEXT]


@dataclass
class Request:
    """The module's parameters."""

    state: str
    worker_url: str = ""
    worker_api_key: str | None = None
    wait: bool = True
    timeout: float = 120.0
    min_healthy_others: int = 1
    drain_metrics_url: str | None = None
    drain_timeout: float = 600.0
    poll_interval: float = 1.0
    request_timeout: float = 10.0
    check_mode: bool = False


def wait_until_healthy(
    client: RouterClient, req: Request, job_id: str | None, clock: Clock
) -> list[dict[str, Any]]:
    """Poll until the router lists the worker as healthy; a failed registration job ends it."""
    deadline = clock.monotonic() + req.timeout
    last_state = "not listed yet"
    while True:
        workers = client.list_workers()
        worker = find_worker(workers, req.worker_url)
        if worker is not None and worker.get("is_healthy") is True:
            return workers
        if worker is not None:
            last_state = "listed but not healthy"
        elif job_id:
            status, message = job_state(client.get_worker(job_id), job_id)
            if status == "failed":
                raise RouterError(
                    f"the router could not register {req.worker_url}: "
                    f"{message or 'its registration job failed'}"
                )
            if status:
                last_state = f"registration job {status}"
        if clock.monotonic() >= deadline:
            raise RouterError(
                f"{req.worker_url} is not a healthy worker of the router after "
                f"{req.timeout:g} s ({last_state})"
            )
        clock.sleep(req.poll_interval)


def wait_until_gone(client: RouterClient, req: Request, clock: Clock) -> list[dict[str, Any]]:
    deadline = clock.monotonic() + req.timeout
    while True:
        workers = client.list_workers()
        if find_worker(workers, req.worker_url) is None:
            return workers
        if clock.monotonic() >= deadline:
            raise RouterError(
                f"the router still lists {req.worker_url} {req.timeout:g} s after its removal"
            )
        clock.sleep(req.poll_interval)


def parse_in_flight(metrics_text: str) -> float | None:
    """Running plus queued requests over every label set, or None when neither gauge is there.

    ValueError for a reading that is no count (negative, NaN, infinite): running 1 and queued
    -1 must never add up to a drained replica."""
    total = 0.0
    found = False
    for line in metrics_text.splitlines():
        match = _SAMPLE_RE.match(line)
        if not match or match.group(1) not in DRAIN_METRICS:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{match.group(1)} reads {match.group(2)}, not a count of requests")
        total += value
        found = True
    return total if found else None


def read_in_flight(url: str, timeout: float, send: Callable[..., Response] = request) -> float:
    shown = redact_url(url)
    try:
        answer = send(url, deadline_s=timeout, max_bytes=_MAX_ANSWER_BYTES)
    except HttpError as err:
        raise RouterError(f"cannot read drain_metrics_url: {err}") from None
    if answer.status != 200:
        raise RouterError(
            f"drain_metrics_url {shown} answered {answer.status}: the replica must run with "
            "--enable-metrics (sglang_server flag enable_metrics: true)"
        )
    try:
        in_flight = parse_in_flight(answer.body.decode("utf-8", errors="replace"))
    except ValueError as err:
        raise RouterError(f"drain_metrics_url {shown}: {err}") from None
    if in_flight is None:
        raise RouterError(
            f"drain_metrics_url {shown} has neither {' nor '.join(DRAIN_METRICS)}: is it an "
            "SGLang server's /metrics?"
        )
    return in_flight


def drain(req: Request, clock: Clock, send: Callable[..., Response] = request) -> dict[str, Any]:
    """Wait until the replica runs and queues nothing (two readings in a row), bounded."""
    url = req.drain_metrics_url or ""
    start = clock.monotonic()
    zeros = 0
    while True:
        in_flight = read_in_flight(url, req.request_timeout, send)
        zeros = zeros + 1 if in_flight == 0 else 0
        elapsed = round(clock.monotonic() - start, 2)
        if zeros >= _ZERO_READINGS:
            return {"drained": True, "running_reqs": in_flight, "drain_seconds": elapsed}
        if elapsed >= req.drain_timeout:
            return {"drained": False, "running_reqs": in_flight, "drain_seconds": elapsed}
        clock.sleep(req.poll_interval)


def ensure_present(client: RouterClient, req: Request, clock: Clock) -> dict[str, Any]:
    workers = client.list_workers()
    worker = find_worker(workers, req.worker_url)
    changed = worker is None
    if req.check_mode:
        return {"changed": changed, "workers": workers}
    job_id = None
    if changed:
        job_id = client.add_worker(req.worker_url, req.worker_api_key)
    healthy = worker is not None and worker["is_healthy"] is True
    if req.wait and not healthy:
        workers = wait_until_healthy(client, req, job_id, clock)
    elif changed:
        workers = client.list_workers()
    return {"changed": changed, "workers": workers}


def ensure_absent(
    client: RouterClient, req: Request, clock: Clock, send: Callable[..., Response]
) -> dict[str, Any]:
    workers = client.list_workers()
    worker = find_worker(workers, req.worker_url)
    if worker is not None:
        others = healthy_others(workers, req.worker_url)
        if others < req.min_healthy_others:
            healthy = [w["url"] for w in workers if w["is_healthy"] is True]
            raise RouterError(
                f"refusing to remove {req.worker_url}: {others} other healthy worker(s) would be "
                f"left, min_healthy_others is {req.min_healthy_others} (healthy now: {healthy})"
            )
    result: dict[str, Any] = {"changed": worker is not None, "drained": None}
    if req.check_mode:
        return {**result, "workers": workers}
    if worker is not None:
        client.remove_worker(worker["id"])
        workers = wait_until_gone(client, req, clock) if req.wait else client.list_workers()
    result["workers"] = workers
    if req.drain_metrics_url:
        result.update(drain(req, clock, send))
    return result


def check_numbers(req: Request) -> None:
    """Every wait bounded and every sleep positive: a timeout of inf or NaN (Ansible's float
    reads "1e400" and "nan") would poll for ever, a negative interval would end in a traceback."""
    for name, allowed in NUMBERS.items():
        try:
            read(getattr(req, name), name, allowed, text=False)
        except NumberError as err:
            raise RouterError(str(err)) from None


def check_urls(router_url: str, req: Request) -> None:
    """router_url and drain_metrics_url readable by the reader, router_url the router's base URL
    (a path or query there would end up in front of /workers), and no worker that is the router
    itself (a router that routes to itself loops every request)."""
    if not _ROUTER_URL_RE.fullmatch(router_url):
        raise RouterError(
            f"router_url {redact_url(router_url)!r} must be http(s)://host[:port] with no "
            "path, query or fragment (the module adds /workers)"
        )
    try:
        _scheme, router_host, router_port, _path = check_url(router_url, "router_url")
        if req.drain_metrics_url:
            check_url(req.drain_metrics_url, "drain_metrics_url")
    except HttpError as err:
        raise RouterError(str(err)) from None
    if req.worker_url and not check_worker_url(req.worker_url):
        _scheme, host, port, _path = check_url(req.worker_url, "worker_url")
        if (host.lower(), port) == (router_host.lower(), router_port):
            raise RouterError(
                f"worker_url {redact_url(req.worker_url)} is the router itself "
                f"({redact_url(router_url)}): a worker must be an SGLang server"
            )


def run(
    client: RouterClient,
    req: Request,
    clock: Clock | None = None,
    send: Callable[..., Response] = request,
) -> dict[str, Any]:
    """Carry out one request; raises RouterError with the operator's message."""
    clock = clock or Clock()
    check_numbers(req)
    check_urls(client.base_url, req)
    if req.state == "list":
        return {"changed": False, "workers": summarize(client.list_workers())}
    if not req.worker_url:
        raise RouterError(f"worker_url is required with state={req.state}")
    problem = check_worker_url(req.worker_url)
    if problem:
        raise RouterError(problem)
    if req.state == "present":
        result = ensure_present(client, req, clock)
    else:
        result = ensure_absent(client, req, clock, send)
    worker = find_worker(result["workers"], req.worker_url)
    result["worker"] = {key: worker[key] for key in _LISTED_FIELDS} if worker else None
    result["workers"] = summarize(result["workers"])
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "router_url": {"type": "str", "required": True},
            "api_key": {"type": "str", "no_log": True},
            "state": {
                "type": "str",
                "choices": ["present", "absent", "list"],
                "default": "present",
            },
            "worker_url": {"type": "str"},
            "worker_api_key": {"type": "str", "no_log": True},
            "wait": {"type": "bool", "default": True},
            "timeout": {"type": "float", "default": 120.0},
            "min_healthy_others": {"type": "int", "default": 1},
            "drain_metrics_url": {"type": "str"},
            "drain_timeout": {"type": "float", "default": 600.0},
            "poll_interval": {"type": "float", "default": 1.0},
            "request_timeout": {"type": "float", "default": 10.0},
        },
        required_if=[("state", "present", ["worker_url"]), ("state", "absent", ["worker_url"])],
        supports_check_mode=True,
    )
    p = module.params
    client = RouterClient(
        p["router_url"], p["api_key"] or None, p["request_timeout"], hidden=(p["worker_api_key"],)
    )
    req = Request(
        state=p["state"],
        worker_url=p["worker_url"] or "",
        worker_api_key=p["api_key"] if p["worker_api_key"] is None else p["worker_api_key"],
        wait=p["wait"],
        timeout=p["timeout"],
        min_healthy_others=p["min_healthy_others"],
        drain_metrics_url=p["drain_metrics_url"],
        drain_timeout=p["drain_timeout"],
        poll_interval=p["poll_interval"],
        request_timeout=p["request_timeout"],
        check_mode=module.check_mode,
    )
    try:
        result = run(client, req)
    except RouterError as err:
        module.fail_json(msg=client.safe(err))
    if result.get("drained") is False:
        module.warn(
            f"{p['worker_url']} still had {result['running_reqs']:g} running or queued requests "
            f"after drain_timeout {p['drain_timeout']:g} s"
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
