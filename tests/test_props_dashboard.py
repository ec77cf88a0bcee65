"""Property-based tests of `python -m sglang_fleet.monitoring.dashboard` (Hypothesis; profiles in
conftest.py).

Entry points: the command line (main: any --prometheus, --minutes, --rate-interval) and what it
does with any answer Prometheus could give (http_getter, then fetch). The HTTP reader itself is
replaced here by one that answers from the generated data (fleet_http has its own tests), so no
example touches the network. Invariants: exit status 0, 1 or a usage error (2), never another
exception; an error is one line that starts with "dashboard: "; a password in the URL is never
printed; an answer is either read as a matrix of numbers or refused with DashboardError.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from sglang_fleet.module_utils.fleet_http import HttpError, Response

from sglang_fleet.monitoring import dashboard

SECRET = "pw-0d9e7c"
urls = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "http://gw:9090",
            f"http://u:{SECRET}@gw:9090",
            "http://gw:99999",
            "ftp://gw",
            "http://[::1]:9090/prom",
            "http://gw:09090",
            "http://g w",
            f"https://{SECRET}@gw",
            "http://gw:9090/\n",
        ]
    ),
    st.builds(lambda host, port: f"http://{host}:{port}", st.text(max_size=12), st.integers()),
)
options = st.lists(
    st.one_of(
        st.tuples(st.just("--minutes"), st.one_of(st.text(max_size=8), st.floats().map(str))),
        st.tuples(st.just("--rate-interval"), st.one_of(st.text(max_size=8),
                                                        st.sampled_from(["5m", "1h30m", "0"]))),
    ),
    max_size=2,
)  # fmt: skip
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=12,
)
matrix_like = st.fixed_dictionaries(
    {
        "status": st.sampled_from(["success", "error", 7]),
        "data": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {
                    "result": st.lists(
                        st.fixed_dictionaries(
                            {
                                "metric": st.dictionaries(
                                    st.text(max_size=5), json_values, max_size=2
                                ),
                                "values": st.lists(st.lists(json_values, max_size=3), max_size=3),
                            }
                        ),
                        max_size=3,
                    )
                }
            ),
        ),
    }
)
bodies = st.one_of(
    st.binary(max_size=64),
    json_values.map(lambda v: json.dumps(v).encode()),
    matrix_like.map(lambda v: json.dumps(v).encode()),
    st.integers(1, 3000).map(lambda n: b"[" * n),
)


def unreachable(url: str, **_kwargs: Any) -> Response:
    raise HttpError("unreachable", f"cannot reach {dashboard.redact_url(url)}: refused")


@given(urls, options)
def test_the_command_line_exits_cleanly_and_never_prints_a_password(
    url: str, given_options: list[tuple[str, str]]
) -> None:
    argv = ["--prometheus", url, *[part for option in given_options for part in option]]
    err, out = io.StringIO(), io.StringIO()
    original, dashboard.request = dashboard.request, unreachable
    try:
        with (
            tempfile.TemporaryDirectory() as folder,
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(out),
        ):
            try:
                code: Any = dashboard.main([*argv, str(Path(folder) / "p.png")])
            except SystemExit as exc:
                code = exc.code
    finally:
        dashboard.request = original
    said = err.getvalue()
    assert code in (1, 2), (argv, said)
    assert SECRET not in said and SECRET not in out.getvalue()
    if code == 1:
        assert said.startswith("dashboard: ") and said.count("\n") == 1, said


@given(st.integers(100, 599), bodies)
def test_any_answer_is_read_as_a_matrix_or_refused(status: int, body: bytes) -> None:
    def answer(_url: str, **_kwargs: Any) -> Response:
        return Response(status, "", {}, body)

    original, dashboard.request = dashboard.request, answer
    try:
        get = dashboard.http_getter("http://prometheus.lan:9090")
        item = {"panel": "p", "expr": "up", "legend": "{{host}}"}
        try:
            [fetched] = dashboard.fetch(get, [item], 0.0, 60.0, 1.0)
        except dashboard.DashboardError as exc:
            assert str(exc) and "\n" not in str(exc)
            return
    finally:
        dashboard.request = original
    assert status == 200
    for name, times, values in fetched["series"]:
        assert isinstance(name, str)
        assert len(times) == len(values)
        assert all(isinstance(v, float) for v in times + values)
        assert all(math.isfinite(t) or math.isnan(t) or math.isinf(t) for t in times)
