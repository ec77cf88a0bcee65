"""The Grafana dashboard's queries parse (promtool), and its PNG is drawn from Prometheus data.

That each query also returns data is checked against a live Prometheus in the monitoring
scenario (molecule/monitoring).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sglang_fleet.monitoring import dashboard

PROMTOOL = shutil.which("promtool")


def test_every_panel_has_a_query_and_grafana_finds_our_data_source() -> None:
    board = dashboard.load_dashboard()
    assert board["uid"] == "sglang-fleet"
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "sglang-fleet-prometheus"
    assert len(dashboard.queries(board)) == 18
    assert set(dashboard.MAIN_PANELS) <= {p["title"] for p in board["panels"]}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing: run scripts/ensure-host-tools.sh")
def test_every_query_parses(tmp_path: Path) -> None:
    """promtool has no expression checker of its own: each query becomes a recording rule."""
    items = dashboard.queries(dashboard.load_dashboard(), "5m")
    assert not any("$" in item["expr"] for item in items)
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": q["expr"]}
                    for i, q in enumerate(items)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(items)} rules found" in result.stdout


def test_a_broken_query_is_caught(tmp_path: Path) -> None:
    """The check above fails on a query that does not parse (so it can fail at all)."""
    if PROMTOOL is None:
        pytest.skip("promtool missing")
    path = tmp_path / "broken.yml"
    path.write_text(
        yaml.safe_dump(
            {"groups": [{"name": "d", "rules": [{"record": "d:q", "expr": "sum by (host (up)"}]}]}
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0


def fake_prometheus(calls: list[dict[str, str]]) -> dashboard.Getter:
    def get(path: str, params: dict[str, str]) -> dict[str, Any]:
        assert path == "/api/v1/query_range"
        calls.append(params)
        start = float(params["start"])
        return {
            "resultType": "matrix",
            "result": [
                {
                    "metric": {"host": "gpu1", "server": "llama", "gpu": "0"},
                    "values": [[start + 10 * i, str(i)] for i in range(5)],
                }
            ],
        }

    return get


def test_snapshot_asks_for_the_main_panels_and_draws_a_png(tmp_path: Path) -> None:
    calls: list[dict[str, str]] = []
    png = tmp_path / "panels.png"
    fetched = dashboard.snapshot(
        fake_prometheus(calls), png, 10, rate_interval="30s", now=1_000_000.0
    )
    main_queries = [
        q
        for q in dashboard.queries(dashboard.load_dashboard(), "30s")
        if q["panel"] in dashboard.MAIN_PANELS
    ]
    assert [c["query"] for c in calls] == [q["expr"] for q in main_queries]
    assert calls[0]["start"] == str(1_000_000.0 - 600) and calls[0]["end"] == str(1_000_000.0)
    assert fetched[0]["series"][0][0] == "gpu1/llama"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_legend_fills_grafana_labels() -> None:
    assert (
        dashboard.legend("running {{host}}/{{server}}", {"host": "a", "server": "b"})
        == "running a/b"
    )
    assert json.loads(dashboard.legend("", {"x": "1"})) == {"x": "1"}
