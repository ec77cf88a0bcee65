"""A router's worker list of every shape, read by each of its readers (issue 44: fail closed).

The readers are plugins/module_utils/router_workers.py (the one parser),
plugins/modules/sglang_router_workers.py (take-out, drain, put-back),
plugins/modules/sglang_host_state.py (does the router list the replica?) and
sglang_fleet/rollout/driver_upgrade.py (the N-1 rule). A list of a shape they do not understand is a
clean error naming the router, and nothing is decided on it: no DELETE, no "does not list"
difference, no driver rollout. The real router's shape (sglang-router 0.3.2, captured from
tests/test_sglang_router_workers.py's real router) reads as it is.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from conftest import load_plugin

from sglang_fleet.rollout import driver_upgrade

mod = load_plugin("plugins/modules/sglang_router_workers.py")
state = load_plugin("plugins/modules/sglang_host_state.py")

ROUTER = "http://127.0.0.1:30000"
W1, W2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
UUID1, UUID2 = "2d3cdd1d-d76d-48ef-a22b-9edf3ac34b1f", "5b2a4f47-cf1f-46af-bada-f11e53f9bb1c"


def real_worker(worker_id: str, url: str, healthy: bool = True) -> dict[str, Any]:
    """One entry of GET /workers as sglang-router 0.3.2 answered it (captured)."""
    return {
        "id": worker_id,
        "url": url,
        "model_id": "/models/llama-3.1-8b-instruct",
        "priority": 50,
        "cost": 1.0,
        "worker_type": "regular",
        "is_healthy": healthy,
        "load": 0,
        "connection_mode": "HTTP",
        "metadata": {"tp_size": "1", "model_type": "llama", "disaggregation_mode": "null"},
        "disable_health_check": False,
    }


def real_body(*workers: dict[str, Any]) -> dict[str, Any]:
    return {
        "workers": list(workers),
        "total": len(workers),
        "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": len(workers)},
    }


GOOD = real_body(real_worker(UUID1, W1), real_worker(UUID2, W2))

# (id, the answer's JSON, what the error says). Each is a shape the real router never gives.
BAD_SHAPES = [
    ("list-at-top", [real_worker(UUID1, W1)], "a list of 1, not a mapping"),
    ("workers-mapping", {"workers": {"a": real_worker(UUID1, W1)}}, "a mapping as 'workers'"),
    ("workers-missing", {"total": 0}, "null as 'workers'"),
    ("workers-string", {"workers": "http://10.0.0.1:8000"}, "as 'workers', not a list"),
    ("worker-number", real_body(real_worker(UUID1, W1), 7), "worker 1 is a number"),
    ("worker-list", real_body(real_worker(UUID1, W1), [W2, True]), "worker 1 is a list of 2"),
    ("worker-null", real_body(None), "worker 0 is null"),
    ("url-number", real_body(real_worker(UUID1, W1), {**real_worker(UUID2, W2), "url": 12345}),
     "worker 1: its url is a number"),
    ("url-missing", real_body({"id": UUID1, "is_healthy": True}), "its url is null"),
    ("url-empty", real_body(real_worker(UUID1, "")), "its url is empty"),
    ("url-unclosed-bracket", real_body(real_worker(UUID1, "http://[::1:8000")),
     "its url cannot be read"),
    ("url-huge", real_body(real_worker(UUID1, "http://" + "a" * 5000)), "at most 2048"),
    ("url-newline", real_body(real_worker(UUID1, W1 + "\n")), "not printable"),
    ("url-not-ascii", real_body(real_worker(UUID1, "http://hôte:8000")), "not ASCII"),
    ("id-missing", real_body({"url": W1, "is_healthy": True}), "its id is null"),
    ("id-number", real_body({**real_worker(UUID1, W1), "id": 10**30}), "its id is a number"),
    ("healthy-one", real_body({**real_worker(UUID1, W1), "is_healthy": 1}),
     "its is_healthy is a number, not true or false"),
    ("healthy-text", real_body({**real_worker(UUID1, W1), "is_healthy": "true"}),
     "is_healthy is a string"),
    ("healthy-missing", real_body({"id": UUID1, "url": W1}), "is_healthy is null"),
    ("too-many", {"workers": [real_worker(str(i), W1) for i in range(4097)]},
     "lists 4097 workers, more than 4096"),
]  # fmt: skip


def _parser() -> Any:
    """plugins/module_utils/router_workers.py (new in issue 44: imported here, so that the tests of
    the
    readers that use it run, and fail, on the code before it)."""
    from sglang_fleet.module_utils import router_workers  # noqa: PLC0415

    return router_workers


def test_the_real_routers_list_reads_as_it_is() -> None:
    workers = _parser().parse_workers(GOOD, "GET r/workers")
    model = GOOD["workers"][0]["model_id"]
    assert workers == [
        {"id": UUID1, "url": W1, "is_healthy": True, "load": 0, "model_id": model},
        {"id": UUID2, "url": W2, "is_healthy": True, "load": 0, "model_id": model},
    ]


@pytest.mark.parametrize(
    ("answer", "said"), [row[1:] for row in BAD_SHAPES], ids=[row[0] for row in BAD_SHAPES]
)
def test_every_other_shape_is_refused_naming_the_router(answer: Any, said: str) -> None:
    router_workers = _parser()
    with pytest.raises(router_workers.WorkerListError) as caught:
        router_workers.parse_workers(answer, "GET http://gw:30000/workers")
    assert str(caught.value).startswith("GET http://gw:30000/workers")
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("load", "shown"),
    [(3, 3), (2.5, 2.5), (10**400, None), (-1, None), (True, None), ("7", None), (None, None)],
)
def test_a_load_that_is_no_count_is_shown_as_none(load: Any, shown: Any) -> None:
    """The load is only shown (never decided on): a huge or odd one is None, not an error."""
    worker = {**real_worker(UUID1, W1), "load": load}
    assert _parser().parse_worker(worker, "w")["load"] == shown


# --------------------------------------------------------------------------- the module


class FakeSend:
    """fleet_http.request's place: answers GET /workers with a fixed body, records the rest."""

    def __init__(self, body: bytes, status: int = 200) -> None:
        self.body, self.status = body, status
        self.calls: list[tuple[str, str]] = []

    def __call__(self, url: str, method: str = "GET", **_kwargs: Any) -> Any:
        self.calls.append((method, url))
        if method == "GET" and url.endswith("/workers"):
            return mod.Response(self.status, "OK", {}, self.body)
        return mod.Response(202, "Accepted", {}, b'{"status": "accepted"}')


def _run(body: bytes, **kwargs: Any) -> tuple[Any, FakeSend]:
    send = FakeSend(body)
    api = mod.RouterClient(ROUTER, "sk-router-shapes", timeout=5.0, send=send)
    req = mod.Request(**{"poll_interval": 0.01, "timeout": 0.05, **kwargs})
    try:
        return mod.run(api, req), send
    except mod.RouterError as err:
        return err, send


@pytest.mark.parametrize(
    ("answer", "said"), [row[1:] for row in BAD_SHAPES], ids=[row[0] for row in BAD_SHAPES]
)
@pytest.mark.parametrize("state_", ["absent", "present", "list"])
def test_the_module_decides_nothing_on_a_list_it_does_not_understand(
    answer: Any, said: str, state_: str
) -> None:  # fmt: skip
    """Before: workers that were not mappings were skipped, a url that was not a string was
    compared as its str(), a missing id was removed as "None", and an unclosed `[` in any
    listed url ended the module in a ValueError traceback."""
    result, send = _run(json.dumps(answer).encode(), state=state_, worker_url=W1,
                        min_healthy_others=0)  # fmt: skip
    assert isinstance(result, mod.RouterError), result
    assert str(result).startswith(f"GET {ROUTER}/workers"), result
    assert said in str(result)
    assert [method for method, _ in send.calls] == ["GET"]  # no DELETE, no POST


def test_a_worker_that_is_no_mapping_no_longer_counts_the_others_healthy() -> None:
    """Before: the entry 7 was dropped and the url 12345 counted as a healthy other worker, so
    the last real one was taken out."""
    body = real_body(real_worker(UUID1, W1), {**real_worker(UUID2, W2), "url": 12345}, 7)
    result, send = _run(json.dumps(body).encode(), state="absent", worker_url=W1)
    assert isinstance(result, mod.RouterError)
    assert not [call for call in send.calls if call[0] == "DELETE"]


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"<html>gateway</html>", "not JSON"),
        (b'{"workers": "\xff"}', "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 32 levels"),
        (b'{"workers": [' + b"1" * 5000 + b"]}", "not JSON"),
        (json.dumps({"workers": [real_worker(UUID1, W1)] * 20_000}).encode(), "more than 4096"),
    ],
    ids=["html", "not-utf8", "deep", "4300-digit-int", "many-mib"],
)
def test_a_body_that_is_not_a_worker_list_names_the_router(body: bytes, said: str) -> None:
    result, send = _run(body, state="absent", worker_url=W1, min_healthy_others=0)
    assert isinstance(result, mod.RouterError), result
    assert str(result).startswith(f"GET {ROUTER}/workers") and said in str(result)
    assert [method for method, _ in send.calls] == ["GET"]


def test_the_real_shape_still_takes_a_worker_out_by_its_id() -> None:
    body = json.dumps(real_body(real_worker(UUID1, W1), real_worker(UUID2, W2))).encode()
    result, send = _run(body, state="absent", worker_url=W1, wait=False)
    # The fake keeps listing W1: what matters is the DELETE of its id.
    assert ("DELETE", f"{ROUTER}/workers/{UUID1}") in send.calls, result


def test_an_id_is_one_path_segment_whatever_it_holds() -> None:
    body = json.dumps(real_body({**real_worker("../../admin", W1)}, real_worker(UUID2, W2)))
    _, send = _run(body.encode(), state="absent", worker_url=W1, wait=False)
    assert ("DELETE", f"{ROUTER}/workers/..%2F..%2Fadmin") in send.calls


@pytest.mark.parametrize(
    "job",
    [[], "processing", {"status": 3}, {"status": "failed", "message": ["x"]}, {"message": "m"}],
)
def test_a_registration_job_of_an_unknown_shape_is_an_error(job: Any) -> None:
    """Before: a job_status that was not a mapping ended in an AttributeError traceback."""
    with pytest.raises(mod.RouterError, match="job_status of an unknown shape"):
        mod.job_state({"job_status": job}, UUID1)


def test_a_registration_job_reads_as_the_router_gives_it() -> None:
    job = {"job_type": "AddWorker", "worker_url": W1, "status": "processing", "message": None}
    assert mod.job_state({"id": UUID1, "job_status": job}, UUID1) == ("processing", "")
    assert mod.job_state(real_worker(UUID1, W1), UUID1) == ("", "")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("timeout", math.nan),
        ("timeout", math.inf),
        ("timeout", 0.0),
        ("drain_timeout", math.nan),
        ("drain_timeout", -1.0),
        ("poll_interval", -1.0),
        ("poll_interval", math.nan),
        ("request_timeout", math.inf),
        ("min_healthy_others", 10**30),
    ],
)
def test_numbers_that_would_wait_for_ever_are_refused_by_name(name: str, value: Any) -> None:
    """Before: a NaN or infinite timeout polled for ever, a negative interval ended in
    time.sleep's ValueError."""
    result, send = _run(json.dumps(GOOD).encode(), state="present", worker_url=W1,
                        **{name: value})  # fmt: skip
    assert isinstance(result, mod.RouterError) and str(result).startswith(name), result
    assert send.calls == []


@pytest.mark.parametrize(
    "router_url",
    [f"{ROUTER}/prefix", f"{ROUTER}?x=1", f"{ROUTER}/workers", f"{ROUTER}#f", f"{ROUTER}//"],
)
def test_a_router_url_with_a_path_or_query_is_refused_before_any_request(router_url: str) -> None:
    send = FakeSend(json.dumps(GOOD).encode())
    api = mod.RouterClient(router_url, "sk-router-shapes", timeout=5.0, send=send)
    with pytest.raises(mod.RouterError, match="router_url"):
        mod.run(api, mod.Request(state="list"))
    assert send.calls == []


# --------------------------------------------------------------------------- host state


class _Router(BaseHTTPRequestHandler):
    body = b""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


@pytest.fixture
def router() -> Iterator[type[_Router]]:
    handler = type("Handler", (_Router,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("answer", "said"), [row[1:] for row in BAD_SHAPES], ids=[row[0] for row in BAD_SHAPES]
)
def test_host_state_counts_a_list_it_cannot_read_as_unknown(
    router: type[_Router], answer: Any, said: str
) -> None:  # fmt: skip
    """Before: a worker that was not a mapping ended the module in an AttributeError traceback;
    now it is unknown (no "does not list" difference, so no put-back decided on it)."""
    router.body = json.dumps(answer).encode()
    url = router.url  # type: ignore[attr-defined]
    found, unknown = state.check_router(
        {"label": "a", "router_url": url, "worker_url": W2}, None, 5
    )
    assert found == []
    assert len(unknown) == 1 and unknown[0].startswith(f"a: router {url} did not answer")
    assert said in unknown[0]


def test_host_state_reads_the_real_shape(router: type[_Router]) -> None:
    router.body = json.dumps(real_body(real_worker(UUID1, W1))).encode()
    url = router.url  # type: ignore[attr-defined]
    want = {"label": "a", "router_url": url}
    assert state.check_router(
        {**want, "worker_url": W1.upper().replace("HTTP", "http")}, None, 5
    ) == ([], [])
    assert state.check_router({**want, "worker_url": W2}, None, 5) == (
        [f"a: router {url} does not list {W2}"], [],
    )  # fmt: skip


# --------------------------------------------------------------------------- driver rollout


def _reads(workers: Any) -> dict[str, Any]:
    server = {
        "name": "r", "unit": "sglang@r.service", "device": "cuda", "nodes": [], "lkg": True,
        "router": {"url": "http://gw:30000", "worker_url": W1},
    }  # fmt: skip
    return {
        "gpu1": {
            "accelerator": "cuda",
            "driver": {"branch": "580", "installing": True, "gpu_count": 1, "state": "ok"},
            "servers": [server],
            "active_units": ["sglang@r.service"],
            "routers": {"r": {"workers": workers, "error": ""}},
            "min_healthy_others": 1,
        }
    }


@pytest.mark.parametrize(
    "workers",
    [
        ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
        [{"id": "1", "url": W1, "is_healthy": True}, 7],
        [{"id": "1", "url": W1, "is_healthy": True}, {"id": "2", "url": None, "is_healthy": True}],
        [{"id": "1", "url": W1, "is_healthy": True}, {"id": "2", "url": W2, "is_healthy": 1}],
        {"url": W1},
    ],
    ids=["urls", "number", "url-null", "healthy-one", "mapping"],
)
def test_the_driver_rollout_refuses_on_a_list_it_cannot_read(workers: Any) -> None:
    """Before: a worker that was a string or a number ended the plan in an AttributeError (the
    filter lets it through as a traceback), and a url of null counted as a healthy replica."""
    decided = driver_upgrade.plan(["gpu1"], _reads(workers))
    assert decided["problems"], decided
    assert any("its worker list" in problem for problem in decided["problems"]), decided


def test_the_driver_rollout_reads_the_modules_list_as_it_is() -> None:
    workers = [
        {"id": "1", "url": W1, "is_healthy": True, "load": 0, "model_id": "m"},
        {"id": "2", "url": W2, "is_healthy": True, "load": None, "model_id": None},
    ]
    assert driver_upgrade.plan(["gpu1"], _reads(workers))["problems"] == []
