"""Property-based tests of the readers the docs call bounded (Hypothesis; profiles in
tests/conftest.py; issue 44, item 7): a router's worker list as each of its readers takes it,
URLs and host names as the URL rule and the smoke client take them, and the zipapp builder's
command line. Invariants: a clean error naming the input or a correct result; bounded time;
nothing decided (no DELETE, no "does not list", no driver rollout) on a list that was not
understood whole; no credentials in a message; nothing written but the file named.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import stat
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from conftest import load_plugin, stream_fed_in_reads
from hypothesis import given
from hypothesis import strategies as st
from sglang_fleet.module_utils.fleet_http import HttpError, check_url

from sglang_fleet.host_zipapp import build
from sglang_fleet.host_zipapp import main as zipapp_main
from sglang_fleet.rollout import driver_upgrade
from sglang_fleet.smoke.smoke_client.http_client import HttpClient, split_url

mod = load_plugin("plugins/modules/sglang_router_workers.py")
state = load_plugin("plugins/modules/sglang_host_state.py")

ROUTER = "http://127.0.0.1:30000"
W1, W2 = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
# One example of any reader here takes milliseconds; this is far above, and far below a hang.
TIME_BOUND_S = 5.0

# --------------------------------------------------------------------------- worker lists

_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)
_urls = st.one_of(
    st.sampled_from([W1, W2, W1.upper(), "http://[::1", "", " " + W1, W1 + "\n", "http://hôte:1"]),
    _json,
)
_ids = st.one_of(st.sampled_from(["5b2a4f47", "../x", "", "a/b", "x" * 300]), _json)
_health = st.one_of(st.booleans(), st.sampled_from([1, 0, "true", None]), _json)
_worker = st.one_of(
    st.fixed_dictionaries(
        {"id": _ids, "url": _urls, "is_healthy": _health},
        optional={"load": _json, "model_id": _json, "metadata": _json},
    ),
    st.fixed_dictionaries({"id": st.just("w"), "url": st.sampled_from([W1, W2]),
                           "is_healthy": st.booleans()}),
    _json,
)  # fmt: skip
_bodies = st.one_of(
    st.lists(_worker, max_size=4).map(lambda workers: {"workers": workers, "total": 0}),
    _json,
)


def _understood(answer: Any) -> list[dict[str, Any]] | None:  # noqa: PLR0911
    """The test's own account of a list a reader may decide on: the real router's shape."""
    if not isinstance(answer, dict) or not isinstance(answer.get("workers"), list):
        return None
    workers = answer["workers"]
    for worker in workers:
        if not isinstance(worker, dict) or not isinstance(worker.get("is_healthy"), bool):
            return None
        for key, limit in (("id", 256), ("url", 2048)):
            value = worker.get(key)
            if not isinstance(value, str) or not value or len(value) > limit:
                return None
            if not value.isprintable() or value != value.strip():
                return None
        try:
            urllib.parse.urlsplit(worker["url"])
        except ValueError:
            return None
        if not worker["url"].isascii():
            return None
    return workers


class _Send:
    def __init__(self, body: bytes) -> None:
        self.body, self.calls = body, []

    def __call__(self, url: str, method: str = "GET", **_kwargs: Any) -> Any:
        self.calls.append(method)
        if method == "GET" and url.endswith("/workers"):
            return mod.Response(200, "OK", {}, self.body)
        return mod.Response(202, "Accepted", {}, b"{}")


def _key(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path}"


@given(body=_bodies, state_=st.sampled_from(["list", "absent", "present"]),
       others=st.integers(0, 2))  # fmt: skip
def test_the_module_decides_only_on_a_list_it_understood(
    body: Any, state_: str, others: int
) -> None:
    send = _Send(json.dumps(body).encode())
    api = mod.RouterClient(ROUTER, "sk-router-shapes", timeout=5.0, send=send)
    req = mod.Request(state=state_, worker_url=W1, wait=False, min_healthy_others=others)
    started = time.monotonic()
    try:
        result = mod.run(api, req)
    except mod.RouterError as err:
        result, message = None, str(err)
    assert time.monotonic() - started < TIME_BOUND_S
    workers = _understood(body)
    if workers is None:
        assert result is None and message.startswith(f"GET {ROUTER}/workers"), message
        assert send.calls == ["GET"]
        return
    listed = [w for w in workers if _key(w["url"]) == _key(W1)]
    healthy_others = sum(1 for w in workers if w["is_healthy"] and _key(w["url"]) != _key(W1))
    if state_ == "list":
        assert [w["url"] for w in result["workers"]] == [w["url"] for w in workers]
    elif state_ == "absent":
        removes = bool(listed) and healthy_others >= others
        assert ("DELETE" in send.calls) == removes, (send.calls, workers)
        assert result is not None or "refusing to remove" in message
    else:
        assert ("POST" in send.calls) == (not listed)


@given(body=st.one_of(_bodies.map(lambda b: json.dumps(b).encode()), st.binary(max_size=40)))
def test_host_state_never_calls_an_unread_list_a_difference(body: bytes) -> None:
    original = state.request
    state.request = lambda *_a, **_k: mod.Response(200, "OK", {}, body)
    try:
        found, unknown = state.check_router(
            {"label": "a", "router_url": ROUTER, "worker_url": W1}, None, 5
        )
    finally:
        state.request = original
    try:
        workers = _understood(json.loads(body))
    except ValueError:
        workers = None
    if workers is None:
        assert found == [] and len(unknown) == 1 and f"router {ROUTER}" in unknown[0]
    else:
        listed = any(_key(w["url"]) == _key(W1) for w in workers)
        assert unknown == [] and (found == []) == listed


@given(workers=st.one_of(st.lists(_worker, max_size=4), _json))
def test_the_driver_rollout_refuses_on_a_list_it_did_not_understand(workers: Any) -> None:
    server = {"name": "r", "unit": "sglang@r.service", "device": "cuda", "nodes": [],
              "lkg": True, "router": {"url": "http://gw:30000", "worker_url": W1}}  # fmt: skip
    read = {
        "accelerator": "cuda",
        "driver": {"branch": "580", "installing": True, "gpu_count": 1, "state": "ok"},
        "servers": [server],
        "active_units": ["sglang@r.service"],
        "routers": {"r": {"workers": workers, "error": ""}},
        "min_healthy_others": 0,
    }
    decided = driver_upgrade.plan(["gpu1"], {"gpu1": read})
    understood = _understood({"workers": workers or []}) if isinstance(workers, list) else None
    if workers and understood is None:
        assert decided["problems"], decided


# --------------------------------------------------------------------------- URLs

_hosts = st.one_of(
    st.sampled_from([
        "h", "gpu-node-1", "node_1", "h.", "h..", ".", "..", "-h", "a" * 63, "a" * 64,
        ".".join(["a" * 63] * 4), "127.0.0.1", "127.1", "0x7f.1", "1.2.3.4.5", "%68ost",
        "[::1]", "[::1", "::1", "[fe80::1%eth0]", "[v1.x]", "[1.2.3.4]", "[::1]]", "[]",
        "h\\@evil", "h ", "",
    ]),
    st.text(alphabet="ab.-_[]:%@0129 \\", max_size=12),
)  # fmt: skip
_url_parts = st.tuples(
    st.sampled_from(["http", "https", "HTTP", "ftp", "file", ""]),
    st.sampled_from(["://", ":/", ":", ""]),
    st.sampled_from(["", "u:pw-secret@", "@", "u@", ":pw-secret@"]),
    _hosts,
    st.one_of(st.sampled_from(["", ":", ":0", ":80", ":65535", ":65536", ":08", ":8x", ":+1"]),
              st.integers(-1, 10**6).map(lambda n: f":{n}")),
    st.sampled_from(["", "/", "/p", "/a b", "/a%zz", "/%2F", "/p?q=1", "?", "#f", "/p#f"]),
    st.sampled_from(["", "\n", "\r\n", " ", "\t"]),
)  # fmt: skip


def _url(parts: tuple[str, ...]) -> str:
    return "".join(parts)


@given(parts=_url_parts)
def test_the_url_rule_answers_or_refuses_by_name(parts: tuple[str, ...]) -> None:
    url = _url(parts)
    try:
        scheme, host, port, _ = check_url(url, "router_url")
    except HttpError as err:
        assert err.code == "bad_url" and "router_url" in str(err)
        # redact_url's reach: scheme://user:password@ (other spellings: see the notes)
        if re.match(r"(?i)[a-z][a-z0-9+.-]*://", url):
            assert "pw-secret" not in str(err)
        return
    assert scheme in ("http", "https") and 1 <= port <= 65535
    assert host and not any(c.isspace() for c in url) and "#" not in url
    assert "@" not in urllib.parse.urlsplit(url).netloc
    assert url.isascii() and url.isprintable()


@given(parts=_url_parts, random=st.text(max_size=30), use_random=st.booleans())
def test_the_smoke_clients_url_answers_or_refuses_by_name(
    parts: tuple[str, ...], random: str, use_random: bool
) -> None:
    url = random if use_random else _url(parts)
    try:
        split, port = split_url(url)
    except ValueError as err:
        assert "--url" in str(err) and "pw-secret" not in str(err)
        return
    assert split.query == "" and 1 <= port <= 65535
    check_url(url)  # the one rule said yes too
    client = HttpClient(url, None, lambda: 0.0, 1.0)
    head = client.request_bytes("GET", "/generate", None).decode("latin-1")
    # One request line and two headers: nothing in the URL can add a line.
    assert head.count("\r\n") == 4 and head.startswith(f"GET {client.base_path}/generate HTTP")


# --------------------------------------------------------------------------- the zipapp builder

_entries = st.one_of(
    st.sampled_from([
        "sglang_fleet.smoke.smoke_client.command_line", "sglang_fleet.diagnosis.live_metrics",
        "sglang_fleet.smoke.smoke_client.streams", "sglang_fleet", "sglang_fleet.nope.deeper",
        "sglang_fleet..x", "sglang_fleet.smoke.smoke_picture", "json", "../etc/passwd", "",
    ]),
    st.from_regex(r"sglang_fleet(\.[a-z_.]{0,12}){0,3}", fullmatch=True),
    st.text(max_size=20),
)  # fmt: skip
_outputs = st.sampled_from(
    ["out.pyz", "a-folder", "a-fifo", "a-link", "dangling", "missing/x.pyz", "target.txt/x.pyz",
     "x.pyz/", "", "target.txt"]
)  # fmt: skip
_BUILT: dict[str, bytes] = {}


def _setup(folder: Path) -> None:
    (folder / "a-folder").mkdir()
    os.mkfifo(folder / "a-fifo")
    (folder / "target.txt").write_text("target\n")
    (folder / "a-link").symlink_to(folder / "target.txt")
    (folder / "dangling").symlink_to(folder / "made-through-the-link")


@given(entry=_entries, output=_outputs)
def test_the_zipapp_command_line_builds_or_refuses_by_name(entry: str, output: str) -> None:
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        _setup(folder)
        before = sorted(os.listdir(folder))
        target = f"{folder}/{output}" if output else ""
        err = io.StringIO()
        started = time.monotonic()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                status = zipapp_main([entry, "-o", target])
            except SystemExit as done:
                status = int(done.code or 0)
        assert time.monotonic() - started < TIME_BOUND_S
        after = sorted(os.listdir(folder))
        assert os.readlink(folder / "a-link") == str(folder / "target.txt")
        assert not (folder / "made-through-the-link").exists()
        if status == 0:
            if entry not in _BUILT:
                _BUILT[entry] = build(entry)
            assert Path(target).read_bytes() == _BUILT[entry]
            assert stat.S_IMODE(os.lstat(target).st_mode) == 0o755
            assert set(after) - set(before) <= {output}
        else:
            assert status == 2 and "error:" in err.getvalue(), err.getvalue()
            assert "Traceback" not in err.getvalue()
            assert after == before
            assert (folder / "target.txt").read_text() == "target\n"


# --------------------------------------------------------------------------- the smoke stream

_event_kinds = st.sampled_from(["up", "up2", "same", "back", "error", "comment", "done", "odd"])


def _counts(kinds: list[str], expected: int) -> list[int]:
    """The completion_tokens of the stream's counted events, in order (the final one last)."""
    counts, count = [], 0
    for kind in kinds:
        count = {"up": count + 1, "up2": count + 2, "back": max(count - 1, 0)}.get(kind, count)
        if kind not in ("comment", "done"):
            counts.append(count)
    return [*counts, expected]


def _stream(kinds: list[str], expected: int) -> bytes:
    """A /generate stream as SGLang writes it (cumulative text and ids), with what a server
    may also send: a count that stays or goes back, an error beside a count, a comment, an
    early [DONE], a count written another way."""
    out, count = [], 0
    for kind in kinds:
        count = {"up": count + 1, "up2": count + 2, "back": max(count - 1, 0)}.get(kind, count)
        meta = {"id": "r", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": count}
        chunk: dict[str, Any] = {"text": "w " * count, "output_ids": list(range(count)),
                                 "meta_info": meta}  # fmt: skip
        if kind == "error":
            chunk = {"text": chunk["text"], "error": {"message": "boom"}, "meta_info": meta}
        line = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        if kind == "odd":
            line = line.replace(b'"completion_tokens":', b'"completion_tokens":  ')
        out.append({"comment": b": ping\n\n", "done": b"data: [DONE]\n\n"}.get(kind, line))
    meta = {"prompt_tokens": 3, "completion_tokens": expected}
    final = {"text": "w", "meta_info": meta}
    out.append(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
    return b"".join(out)


def _judged(data: bytes, cuts: list[int], expected: int) -> tuple[Any, ...]:
    stream = stream_fed_in_reads(data, cuts, expected)
    record = stream.record
    return stream.reason, record.output_tokens, stream.tokens, round(sum(record.itl), 9)


@given(kinds=st.lists(_event_kinds, max_size=10), cuts=st.lists(st.integers(0, 10**6),
       max_size=5), expected=st.integers(1, 12))  # fmt: skip
def test_the_streams_fast_paths_judge_as_event_by_event_does(
    kinds: list[str], cuts: list[int], expected: int
) -> None:
    """The stream reader takes a read of whole events at a glance (one pass per test over its
    bytes, no JSON): whatever the reads, it judges as when every event comes alone."""
    data = _stream(kinds, expected)
    alone = [index for index in range(len(data)) if data[index - 1 : index + 1] == b"\n\n"]
    assert _judged(data, cuts, expected)[:3] == _judged(data, alone, expected)[:3]
    went_back = any(b < a for a, b in itertools.pairwise(_counts(kinds, expected)))
    if "error" in kinds or went_back:
        assert _judged(data, cuts, expected)[0] is not None  # never a right answer
