"""What playbooks/driver_upgrade.yml decides before it touches a host, and what it says after.

A driver branch change stops a host's servers, installs, reboots and brings them back
(roles/nvidia_driver/README.md, "Changing the branch of a serving fleet"). The playbook's first
play reads every GPU host without changing anything; these functions turn what it read into
the decision:

- which hosts change (the nvidia_driver role would install there: its `nvidia_driver_plan`),
  which of their servers stop (the active ones), and in which order: hosts with a replica
  behind a router one at a time first, then the others in batches of `driver_upgrade_serial`
  (Ansible's own batching, repeated here so the table says which batch a host is in);
- whether the run may start at all. It refuses, naming each reason, when a router would drop
  below N-1 of its N replicas (a replica it lists is unhealthy or missing, a host holds two
  replicas of one router, N-1 is below sglang_server_router_min_healthy_others, the router does
  not answer), when a running server could not come back (no last-known-good record, a server
  across hosts, a CPU server the GPU cleanup does not stop, an sglang@ unit the inventory does
  not describe), or when nvidia-smi does not answer on a host whose servers run (the GPUs cannot
  be proven clear before the reboot);
- the table of all that, and one line per host afterwards (driver before -> after, servers
  restarted, time each was out of service) or, when a host failed, which servers stay down.

Input per host (`reads`), assembled by plugins/filter/sglang_driver.py from hostvars:
  accelerator: cuda or cpu (ml_env_accelerator)
  driver: the nvidia_driver role's nvidia_driver_plan {branch, installing, driver_version,
          gpu_count, state, message}; None on a CPU host
  servers: [{name, unit, device, nodes, router: {url, worker_url} | None, lkg: bool}]
  active_units: sglang@ units active now
  routers: {server name: {workers: [{url, is_healthy, ...}], error: str}} (the router's list as
           the server's own host reads it)
  min_healthy_others: sglang_server_router_min_healthy_others of the host
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

from sglang_fleet.module_utils.router_workers import WorkerListError, parse_workers
from sglang_fleet.module_utils.typed_number import NumberError, Range, finite_or_none, shown
from sglang_fleet.module_utils.typed_number import read as read_number

SERIAL_VAR = "driver_upgrade_serial"
BRANCH_VAR = "nvidia_driver_branch"
MIN_OTHERS_VAR = "sglang_server_router_min_healthy_others"
DEFAULT_SERIAL: list[int | str] = [1, "25%"]
COMMAND = "ansible-playbook playbooks/driver_upgrade.yml"

# Whole strings only (fullmatch): "590\n" is no branch. ASCII digits: str.isdigit() also takes
# "²", which int() then refuses.
_PERCENT_RE = re.compile(r"([0-9]{1,3})%")
_COUNT_RE = re.compile(r"[0-9]{1,9}")
_BRANCH_RE = re.compile(r"[0-9]{1,6}")
BATCH = Range(1, 1 << 31, integer=True)
BRANCH = Range(1, 999_999, integer=True)
GPU_COUNT = Range(0, 4096, integer=True)
MIN_OTHERS = Range(0, 4096, integer=True)
ACCELERATORS = ("cuda", "cpu")


class DriverRolloutError(ValueError):
    """A setting the rollout cannot use; `variable` names what to fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


# --------------------------------------------------------------------------- the settings


def check_serial(value: Any) -> list[int | str]:
    """driver_upgrade_serial as Ansible's `serial` reads it: a batch size, a percentage of the
    hosts ("25%"), or a list of them (the last repeats). Every batch must hold at least one host:
    0, a negative number or "0%" would make Ansible reboot every host at once."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise DriverRolloutError(
            SERIAL_VAR, "is an empty list: give batch sizes such as [1, '25%']"
        )
    checked: list[int | str] = []
    for item in items:
        text = item.strip() if isinstance(item, str) else None
        if isinstance(item, int) and not isinstance(item, bool):
            try:
                checked.append(int(read_number(item, SERIAL_VAR, BATCH)))
                continue
            except NumberError:
                pass
        elif text is not None and _COUNT_RE.fullmatch(text) and int(text) > 0:
            checked.append(int(text))
            continue
        # Ansible reads "x%" only when the text ends in % (helpers.pct_to_int): " 25% " would
        # fail its play after this check passed; int() takes spaces around a count.
        elif (
            isinstance(item, str)
            and (match := _PERCENT_RE.fullmatch(item.lstrip()))
            and 0 < int(match[1]) <= 100
        ):
            checked.append(f"{int(match[1])}%")
            continue
        raise DriverRolloutError(
            SERIAL_VAR,
            f"{shown(item)} is not a batch size: each item is a whole number of hosts above 0 "
            "or a percentage from 1% to 100% (for example [1, 2, '25%']); 0 or less would "
            "change every host at once",
        )
    return checked


def check_branch(value: Any) -> str:
    """nvidia_driver_branch: a driver major version, "590" (an unquoted 590 is read as one)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return str(read_number(value, BRANCH_VAR, BRANCH, text=False))
        except NumberError:
            pass
    elif isinstance(value, str) and _BRANCH_RE.fullmatch(value) and int(value) > 0:
        return value
    raise DriverRolloutError(
        BRANCH_VAR, f'{shown(value)} is not a driver branch: the major version, such as "590"'
    )


def settings_problems(serial: Any, branch: Any = None) -> list[str]:
    """What is wrong with the run's settings (empty when nothing): checked on every host first,
    before any host is read. branch None: not set, the nvidia_driver role's default applies."""
    problems = []
    try:
        check_serial(serial)
    except DriverRolloutError as exc:
        problems.append(str(exc))
    if branch is not None:
        try:
            check_branch(branch)
        except DriverRolloutError as exc:
            problems.append(str(exc))
    return problems


def batches(hosts: list[str], serial: Any) -> list[list[str]]:
    """The batches Ansible makes of `hosts` with this `serial` (its playbook executor: a
    percentage of all hosts of the play, rounded down, at least 1; the last item repeats)."""
    sizes = check_serial(serial)
    left = list(hosts)
    out: list[list[str]] = []
    index = 0
    while left:
        item = sizes[index]
        # A percentage of all the play's hosts, rounded down, at least one.
        size = (int(int(item[:-1]) / 100.0 * len(hosts)) or 1) if isinstance(item, str) else item
        out.append(left[:size])
        left = left[size:]
        index = min(index + 1, len(sizes) - 1)
    return out


# --------------------------------------------------------------------------- the decision


def _typed_read(host: str, read: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the host's read with every field typed, what could not be typed). Each field decides
    whether a host changes, which servers stop, drain and come back, and which GPUs are cleaned
    first; one that is not what the first play writes refuses the run by name, never reads as
    "nothing runs" or "no GPU to clean"."""
    problems: list[str] = []
    accelerator = read.get("accelerator", "cuda")
    if accelerator not in ACCELERATORS:
        problems.append(f"{host}: ml_env_accelerator {shown(accelerator)} is not cuda or cpu")
        accelerator = "cuda"
    driver = read.get("driver")
    if accelerator == "cuda" and not isinstance(driver, Mapping):
        problems.append(
            f"{host}: nvidia_driver_plan was not read (the nvidia_driver role's pre-flight): "
            "whether the driver changes here is not known"
        )
    driver = dict(driver) if isinstance(driver, Mapping) else {}
    installing = driver.get("installing", False)
    if accelerator == "cuda" and not isinstance(installing, bool):
        problems.append(f"{host}: nvidia_driver_plan.installing {shown(installing)} is not a bool")
        installing = True  # its checks are reported with it; the run does not start
    driver["installing"] = installing
    try:
        count = driver.get("gpu_count")
        driver["gpu_count"] = (
            None if count is None else int(read_number(count, "gpu_count", GPU_COUNT))
        )
    except NumberError as err:
        problems.append(
            f"{host}: nvidia_driver_plan.{err}: the GPUs to clean before the reboot are not known"
        )
        driver["gpu_count"] = None
    active = read.get("active_units")
    if not isinstance(active, list) or not all(isinstance(u, str) for u in active):
        problems.append(
            f"{host}: the sglang@ units active now were not read as a list of unit names "
            f"(got {shown(active)}): which servers stop and come back is not known"
        )
        active = []
    servers = read.get("servers")
    if not isinstance(servers, list) or not all(_is_server(s) for s in servers):
        problems.append(f"{host}: the described servers are not a list of servers")
        servers = [s for s in servers if _is_server(s)] if isinstance(servers, list) else []
    try:
        others = int(read_number(read.get("min_healthy_others", 1), MIN_OTHERS_VAR, MIN_OTHERS))
    except NumberError as err:
        problems.append(f"{host}: {err}")
        others = 1
    typed = {
        "accelerator": accelerator,
        "driver": driver if accelerator == "cuda" else None,
        "servers": [dict(s) for s in servers],
        "active_units": list(active),
        "routers": _typed_routers(read.get("routers")),
        "min_healthy_others": others,
    }
    return typed, problems


def _is_server(server: Any) -> bool:
    return (
        isinstance(server, Mapping)
        and isinstance(server.get("name"), str)
        and isinstance(server.get("unit"), str)
        and (server.get("router") is None or _is_router(server["router"]))
    )


def _is_router(router: Any) -> bool:
    return isinstance(router, Mapping) and all(
        isinstance(router.get(key), str) for key in ("url", "worker_url")
    )


def _typed_routers(routers: Any) -> dict[str, dict[str, Any]]:
    """Each router answer as {workers: [{url, is_healthy, ...}], error}; an answer of another
    shape is an error (a router whose replicas cannot be proven healthy)."""
    typed: dict[str, dict[str, Any]] = {}
    for name, answer in (routers or {}).items() if isinstance(routers, Mapping) else []:
        workers = answer.get("workers") if isinstance(answer, Mapping) else None
        error = answer.get("error") if isinstance(answer, Mapping) else None
        if (
            isinstance(workers, list)
            and all(isinstance(w, Mapping) and isinstance(w.get("url"), str) for w in workers)
            and isinstance(error, str | None)
        ):
            typed[str(name)] = {"workers": [dict(w) for w in workers], "error": error or ""}
        else:
            typed[str(name)] = {"workers": [], "error": "its worker list is not one"}
    return typed


def _url_key(url: str) -> str:
    """A URL as sglang-router compares it: scheme and host case-insensitive, the rest as written."""
    parts = urllib.parse.urlsplit(str(url))
    return urllib.parse.urlunsplit(
        (parts.scheme.lower(), parts.netloc.lower(), parts.path, parts.query, parts.fragment)
    )


class _Routers:
    """Routers by identity: one router reached under two URLs (each host names the router as it
    reaches it) is one router when the worker lists they answered share a worker."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        while self.parent[key] != key:
            self.parent[key] = self.parent[self.parent[key]]
            key = self.parent[key]
        return key

    def join(self, one: str, other: str) -> None:
        self.parent[self.find(one)] = self.find(other)


def _active(read: Mapping[str, Any]) -> set[str]:
    return {str(unit) for unit in read.get("active_units") or []}


def _running_servers(read: Mapping[str, Any]) -> list[dict[str, Any]]:
    active = _active(read)
    return [dict(s) for s in read.get("servers") or [] if str(s.get("unit")) in active]


def _needs_change(read: Mapping[str, Any]) -> bool:
    driver = read.get("driver") or {}
    return read.get("accelerator", "cuda") == "cuda" and bool(driver.get("installing"))


def _host_problems(host: str, read: Mapping[str, Any]) -> list[str]:
    """What would keep this host's running servers from coming back after its driver changes."""
    problems = []
    running = _running_servers(read)
    described = {str(s.get("unit")) for s in read.get("servers") or []}
    unknown = sorted(_active(read) - described)
    if unknown:
        problems.append(
            f"{host}: {', '.join(unknown)} run(s) but no server of this host's inventory "
            "(sglang_server_instances) is that unit: the rolling path cannot stop and restart "
            "it; stop it by hand or describe it"
        )
    for server in running:
        name = server.get("name")
        if server.get("nodes"):
            problems.append(
                f"{host}: {name} runs across hosts ({', '.join(server['nodes'])}): "
                "driver_upgrade.yml does not roll servers across hosts; stop it on every node "
                "first (playbooks/gpu_cleanup.yml), deploy.yml starts it again afterwards"
            )
        elif server.get("device") == "cpu":
            problems.append(
                f"{host}: {name} runs on SGLang's CPU engine: the GPU cleanup before the driver "
                "change does not stop it, and the reboot would; stop it first"
            )
        elif not server.get("lkg"):
            problems.append(
                f"{host}: {name} runs without a last-known-good record: the rolling path starts "
                "each server again on its last-known-good files; roll it out with deploy.yml "
                "first, which records one when it passes its gates"
            )
    driver = read.get("driver") or {}
    if running and driver.get("gpu_count") in (None, 0):
        problems.append(
            f"{host}: servers run ({', '.join(s['name'] for s in running)}) but nvidia-smi does "
            f"not answer ({driver.get('message') or driver.get('state') or 'no answer'}): the "
            "GPUs cannot be proven clear before the reboot; stop the servers and look at the "
            "driver by hand"
        )
    return problems


def _router_groups(
    hosts: list[str], reads: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Every router once: {url (as the first replica names it), members: [(host, server)],
    workers: {url: worker} (all the lists it answered, each worker once), errors}."""
    routers = _Routers()
    members: list[tuple[str, dict[str, Any]]] = []
    answers: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    for host in hosts:
        read = reads.get(host) or {}
        for server in read.get("servers") or []:
            if not server.get("router"):
                continue
            members.append((host, dict(server)))
            answer = _router_answer(read.get("routers"), server, host)
            answers.append((host, dict(server), answer))
            for worker in answer.get("workers") or []:
                routers.join("worker " + _url_key(worker.get("url", "")), _router_key(server))
    groups: dict[str, dict[str, Any]] = {}
    for host, server in members:
        group = groups.setdefault(
            routers.find(_router_key(server)),
            {"url": server["router"]["url"], "members": [], "workers": {}, "errors": []},
        )
        group["members"].append((host, server))
    for host, server, answer in answers:
        group = groups[routers.find(_router_key(server))]
        if answer.get("error"):
            group["errors"].append(
                f"router {server['router']['url']} (asked from {host} for {server.get('name')}): "
                f"{answer['error']}: the router's replicas cannot be proven healthy"
            )
        for worker in answer.get("workers") or []:
            # Two reads of one router that disagree: the unhealthy one counts.
            seen = group["workers"].setdefault(_url_key(worker.get("url", "")), dict(worker))
            if worker.get("is_healthy") is not True:
                seen["is_healthy"] = worker.get("is_healthy")
    return list(groups.values())


def _router_answer(routers: Any, server: Mapping[str, Any], host: str) -> dict[str, Any]:
    """{workers, error} of the server's router as its host read it, every worker understood
    (plugins/module_utils/router_workers.py); a list of another shape is an error, so the N-1 rule
    is
    never judged on the part of a list that could be read."""
    answer = routers.get(server.get("name")) if isinstance(routers, Mapping) else None
    if not isinstance(answer, Mapping):
        return {"workers": [], "error": "no answer was kept for this server"}
    error = answer.get("error")
    try:
        workers = parse_workers({"workers": answer.get("workers") or []}, "its worker list")
    except WorkerListError as err:
        return {"workers": [], "error": f"{error}; {err}" if error else str(err)}
    return {"workers": workers, "error": error}


def _router_key(server: Mapping[str, Any]) -> str:
    return _url_key(server["router"]["url"])


def _router_problems(
    group: Mapping[str, Any], reads: Mapping[str, Mapping[str, Any]], changing: list[str]
) -> list[str]:
    """The N-1 rule for one router that loses a replica while a host changes: it lists all its
    replicas healthy now, loses one at a time, and keeps min_healthy_others others."""
    leaving: dict[str, list[str]] = {}
    for host, server in group["members"]:
        if host in changing and server["unit"] in _active(reads.get(host) or {}):
            leaving.setdefault(host, []).append(str(server["name"]))
    if not leaving or group["errors"]:
        return list(group["errors"]) if leaving else []
    shown, workers = group["url"], group["workers"]
    total = len(workers)
    problems = [
        f"router {shown}: {server['name']} on {host} ({server['router']['worker_url']}) is not "
        "in its worker list, so the router serves with fewer than all its replicas already; "
        "bring it back first (deploy.yml puts a running replica back, and starts a stopped one)"
        for host, server in group["members"]
        if _url_key(server["router"]["worker_url"]) not in workers
    ]
    problems += [
        f"router {shown}: worker {url} is not healthy: taking out another replica would leave "
        f"fewer than N-1 of its {total}; bring it back first"
        for url, worker in sorted(workers.items())
        if worker.get("is_healthy") is not True
    ]
    for host, names in leaving.items():
        if len(names) > 1:
            problems.append(
                f"router {shown}: {host} holds {len(names)} of its replicas ({', '.join(names)}): "
                f"the host's reboot takes them out together, below N-1 of {total}"
            )
        wanted = (reads.get(host) or {}).get("min_healthy_others", 1)
        if total - 1 < wanted:
            problems.append(
                f"router {shown} lists {total} replica(s): taking the one on {host} out leaves "
                f"{max(total - 1, 0)}, fewer than {MIN_OTHERS_VAR} ({wanted}); add a replica "
                "first, or set it to 0 on that host to accept the outage"
            )
    return problems


def plan(
    hosts: list[str], reads: Mapping[str, Mapping[str, Any]], serial: Any = None
) -> dict[str, Any]:
    """The rollout's decision: {problems, routed, direct, hosts: {host: {...}}, lines}.

    routed: the hosts that change and run a replica behind a router, one at a time, in `hosts`'
    order; direct: the other hosts that change, in batches of `serial`. problems not empty: the
    run must not start (every host fails with them, nothing changed)."""
    serial = DEFAULT_SERIAL if serial is None else serial
    problems = settings_problems(serial)
    typed: dict[str, dict[str, Any]] = {}
    for host in hosts:
        read = reads.get(host)
        typed[host], input_problems = _typed_read(host, read if isinstance(read, Mapping) else {})
        problems.extend(input_problems)
    reads = typed
    changing = [h for h in hosts if _needs_change(reads.get(h) or {})]
    for host in changing:
        problems.extend(_host_problems(host, reads.get(host) or {}))
    for group in _router_groups(hosts, reads):
        problems.extend(_router_problems(group, reads, changing))
    routed = [
        h for h in changing if any(s.get("router") for s in _running_servers(reads.get(h) or {}))
    ]
    direct = [h for h in changing if h not in routed]
    order: dict[str, str] = {}
    for number, host in enumerate(routed, 1):
        order[host] = f"alone, {number} of {len(routed)} (replicas behind a router)"
    try:
        direct_batches = batches(direct, serial)
    except DriverRolloutError:
        direct_batches = []  # already a problem: the run does not start
    for number, batch in enumerate(direct_batches, 1):
        canary = number == 1 and len(batch) == 1 and len(direct) > 1
        for host in batch:
            order[host] = f"batch {number} of {len(direct_batches)}" + (
                " (canary)" if canary else ""
            )
    out_hosts: dict[str, dict[str, Any]] = {}
    for host in hosts:
        read = reads.get(host) or {}
        driver = read.get("driver") or {}
        change = host in changing
        stop = [s["name"] for s in _running_servers(read)] if change else []
        if read.get("accelerator", "cuda") != "cuda":
            when = "CPU host: no driver"
        elif not change:
            when = "up to date"
        else:
            when = order.get(host, "")
        out_hosts[host] = {
            "change": change,
            "driver_version": driver.get("driver_version"),
            "branch": driver.get("branch"),
            "stop": stop,
            "routed": host in routed,
            "clean_gpus": list(range(driver.get("gpu_count") or 0)),
            "when": when,
        }
    return {
        "problems": problems,
        "routed": routed,
        "direct": direct,
        "hosts": out_hosts,
        "lines": table(hosts, out_hosts),
    }


def table(hosts: list[str], decided: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per host: the driver now, the branch wanted, the servers that stop, when."""
    rows = [("HOST", "DRIVER NOW", "BRANCH", "SERVERS THAT STOP", "WHEN")]
    for host in hosts:
        entry = decided.get(host) or {}
        rows.append(
            (
                host,
                str(entry.get("driver_version") or "-"),
                str(entry.get("branch") or "-") if entry.get("change") else "-",
                ", ".join(entry.get("stop") or []) or "-",
                str(entry.get("when") or ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True))
        + "  "
        + row[-1]
        for row in rows
    ]


# --------------------------------------------------------------------------- afterwards


def _seconds(start: Any, end: Any) -> float | None:
    """end - start in seconds, None when either is no finite number (a huge integer, text)."""
    begun, ended = finite_or_none(start), finite_or_none(end)
    if begun is None or ended is None:
        return None
    value = ended - begun
    return value if 0 <= value < float("inf") else None


def host_summary(
    host: str,
    before: Any,
    after: Any,
    restarted: list[Mapping[str, Any]] | None,
    stopped_at: Any,
) -> str:
    """The line a host ends with: driver before -> after, and each server restarted with the
    time it was out of service (from the stop before the driver change to its passed health
    gate). restarted: [{name, healthy_at}] in the order the servers came back."""
    parts = []
    for server in restarted or []:
        seconds = _seconds(stopped_at, server.get("healthy_at"))
        parts.append(
            f"{server.get('name')} (out of service {seconds:.1f} s)"
            if seconds is not None
            else str(server.get("name"))
        )
    servers = "restarted " + ", ".join(parts) if parts else "no server to restart"
    return f"{host}: driver {before or 'none'} -> {after or 'unknown'}; {servers}; gates passed"


def down_report(
    host: str,
    stopped: list[str] | None,
    active_units: list[str] | None,
    servers: list[Mapping[str, Any]] | None,
    failure: str,
    *,
    restarted: list[str] | None = None,
) -> str:
    """Why a host failed and the state its servers are left in: those this run stopped that do
    not run now stay down, until the driver is fixed and playbooks/rollback.yml starts them;
    restarted: the ones that came back through their gates before the failure."""
    active = {str(u) for u in active_units or []}
    units = {str(s.get("name")): str(s.get("unit")) for s in servers or []}
    back = [name for name in restarted or [] if units.get(name) in active]
    down = [name for name in stopped or [] if units.get(name) not in active]
    running = [name for name in stopped or [] if units.get(name) in active and name not in back]
    lines = [f"{host}: the driver change failed: {failure.strip().rstrip('.')}."]
    if down:
        lines.append(
            f"Down, left stopped: {', '.join(down)}. Fix the driver, then start them with "
            f"playbooks/rollback.yml --limit {host} (their last-known-good files, gated)."
        )
    if back:
        lines.append(f"Back and serving (gates passed): {', '.join(back)}.")
    if running:
        lines.append(
            f"Running, not through this run's gates: {', '.join(running)} (a replica behind a "
            "router may be out of it: deploy.yml puts a running replica back)."
        )
    if not down and not running and not back:
        lines.append("No server of this host was stopped.")
    lines.append("The rollout stops here; hosts after this one were not touched.")
    return " ".join(lines)
