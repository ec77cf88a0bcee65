"""The fleet dashboard's queries, and a PNG of its main panels from Prometheus's HTTP API.

    python -m sglang_fleet.monitoring.dashboard --prometheus http://gateway:9090 OUT.png [--minutes
    30]

For operators without a Grafana (it is not in Debian): the dashboard JSON the monitoring role
provisions (roles/monitoring/files/sglang-fleet-dashboard.json) is the one source of queries;
this module reads them, asks Prometheus for each over a time range (/api/v1/query_range) and
draws the main panels with matplotlib, like sglang_fleet.smoke.smoke_picture draws a smoke run. The
same
queries are what the tests check: each parses (promtool) and returns data in the monitoring
scenario (docs/MONITORING.md).

Prometheus is read through the project's one HTTP reader (plugins/module_utils/fleet_http.py: one
deadline per request, a size cap, no redirect followed, no proxy from the environment, no
credentials in the URL), its answers checked before use: anything it cannot use (a bad URL or
option, an unreachable or slow Prometheus, an answer that is not the JSON Prometheus gives, a bad
dashboard file) ends in one line naming what was wrong and exit status 1 (2 for a bad option),
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.bounded_file import read_regular
from sglang_fleet.module_utils.fleet_http import HttpError, check_url, redact_url, request
from sglang_fleet.module_utils.typed_number import Range
from sglang_fleet.monitoring.settings import SettingError, duration_ms

DASHBOARD = Path(__file__).resolve().parents[2] / "roles" / "monitoring" / "files"
DASHBOARD_JSON = DASHBOARD / "sglang-fleet-dashboard.json"
# Grafana's own variable; outside Grafana a range of at least four scrape intervals.
RATE_INTERVAL = "$__rate_interval"
# The panels the PNG shows (titles in the dashboard), two columns.
MAIN_PANELS = (
    "Generation throughput (tokens/s)",
    "Requests running and queued",
    "KV cache token usage",
    "TTFT p95 and SLO",
    "GPU memory used (MiB)",
    "GPU memory held by no server of ours (MiB)",
)

# Bounds: one request (a range query of six panels' series) and the dashboard file.
DEADLINE_S = 30.0
MAX_ANSWER_BYTES = 32 << 20
MAX_DASHBOARD_BYTES = 4 << 20
MAX_MINUTES = 31 * 24 * 60

Getter = Callable[[str, dict[str, str]], dict[str, Any]]


class DashboardError(Exception):
    """What stopped the picture, in one line that is safe to print (no credentials)."""


def _json(data: bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise DashboardError(f"{what} nests too deep to be what it claims") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise DashboardError(f"{what} is not JSON: {exc}") from None


def load_dashboard(path: Path = DASHBOARD_JSON) -> dict[str, Any]:
    """The dashboard JSON (a regular file, at most MAX_DASHBOARD_BYTES); DashboardError else."""
    try:
        data = read_regular(str(path), MAX_DASHBOARD_BYTES)
    except (OSError, ValueError) as exc:
        raise DashboardError(f"dashboard {path}: {exc}") from None
    if data is None:
        raise DashboardError(f"dashboard {path} does not exist")
    board = _json(data, f"dashboard {path}")
    if not isinstance(board, dict) or not isinstance(board.get("panels"), list):
        raise DashboardError(f"dashboard {path} has no list of panels (not a Grafana dashboard)")
    return board


def queries(dashboard: dict[str, Any], rate_interval: str = "1m") -> list[dict[str, str]]:
    """Every query of every panel: [{panel, expr, legend}], Grafana's variable filled in."""
    found = []
    for panel in dashboard["panels"]:
        targets = panel.get("targets", []) if isinstance(panel, dict) else None
        if not isinstance(targets, list) or not isinstance(panel.get("title"), str):
            raise DashboardError("the dashboard has a panel without a title or a list of targets")
        for target in targets:
            expr = target.get("expr") if isinstance(target, dict) else None
            shown = target.get("legendFormat", "") if isinstance(target, dict) else None
            if not isinstance(expr, str) or not isinstance(shown, str):
                raise DashboardError(f"panel {panel['title']!r}: a target without an expr")
            found.append(
                {
                    "panel": panel["title"],
                    "expr": expr.replace(RATE_INTERVAL, rate_interval),
                    "legend": shown,
                }
            )
    return found


def http_getter(
    base_url: str, deadline_s: float | None = None, max_bytes: int | None = None
) -> Getter:
    """GET base_url + path?params from Prometheus's HTTP API through fleet_http; the answer's
    ``data``. DashboardError for anything but a 200 with {"status": "success", "data": {...}}.
    Each request within deadline_s (DEADLINE_S) and at most max_bytes (MAX_ANSWER_BYTES)."""
    deadline_s = DEADLINE_S if deadline_s is None else deadline_s
    max_bytes = MAX_ANSWER_BYTES if max_bytes is None else max_bytes
    try:
        check_url(base_url, "--prometheus")
    except HttpError as exc:
        raise DashboardError(str(exc)) from None

    def get(path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"{base_url.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
        shown = redact_url(f"{base_url.rstrip('/')}{path}")
        try:
            answer = request(url, deadline_s=deadline_s, max_bytes=max_bytes)
        except HttpError as exc:
            raise DashboardError(str(exc)) from None
        body = _json(answer.body, f"the answer of {shown} (HTTP {answer.status})")
        if not isinstance(body, dict):
            raise DashboardError(f"{shown} answered JSON that is not an object")
        if answer.status != 200 or body.get("status") != "success":
            error = str(body.get("error") or body.get("status"))[:200]
            raise DashboardError(f"{shown} answered HTTP {answer.status}: {error}")
        data = body.get("data")
        if not isinstance(data, dict):
            raise DashboardError(f"{shown} answered without a data object")
        return data

    return get


def _series(data: dict[str, Any], item: dict[str, str], end: float) -> list[Any]:
    """A range query's matrix as [(legend, [t - end], [v])]; DashboardError when it is not one."""
    result = data.get("result")
    if not isinstance(result, list):
        raise DashboardError(f"panel {item['panel']!r}: the answer holds no result list")
    series = []
    for entry in result:
        metric = entry.get("metric") if isinstance(entry, dict) else None
        values = entry.get("values") if isinstance(entry, dict) else None
        if not isinstance(metric, dict) or not isinstance(values, list):
            raise DashboardError(f"panel {item['panel']!r}: a series without metric and values")
        try:
            times = [float(t) - end for t, _v in values]
            points = [float(v) for _t, v in values]
        except (TypeError, ValueError):
            raise DashboardError(
                f"panel {item['panel']!r}: values that are not [time, number] pairs"
            ) from None
        if not all(isinstance(v, str) for v in metric.values()):
            raise DashboardError(f"panel {item['panel']!r}: label values that are not text")
        labels = {str(k): v for k, v in metric.items()}
        series.append((legend(item["legend"], labels), times, points))
    return series


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat ({{label}}) filled in from a series' labels."""
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    return text or json.dumps(labels, sort_keys=True)


def fetch(
    get: Getter, items: list[dict[str, str]], start: float, end: float, step: float
) -> list[dict[str, Any]]:
    """Each query's series over [start, end]: items with ``series`` [(legend, [t], [v])] added."""
    fetched = []
    for item in items:
        data = get(
            "/api/v1/query_range",
            {"query": item["expr"], "start": str(start), "end": str(end), "step": str(step)},
        )
        fetched.append({**item, "series": _series(data, item, end)})
    return fetched


def render(fetched: list[dict[str, Any]], png_path: str | Path, title: str) -> Figure:
    """The main panels as one PNG: x in seconds before the end of the range."""
    panels = [p for p in MAIN_PANELS if any(f["panel"] == p for f in fetched)]
    rows = max(1, (len(panels) + 1) // 2)
    figure = Figure(figsize=(13, 3.2 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title, fontsize=12, ha="left", x=0.01)
    axes = figure.subplots(rows, 2, squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("seconds before the end")
        drawn = 0
        for item in (f for f in fetched if f["panel"] == panel):
            for name, times, values in item["series"]:
                ax.plot(times, values, label=name, linewidth=1.2)
                drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    figure.savefig(png_path, format="png")
    return figure


def snapshot(
    get: Getter,
    png_path: str | Path,
    minutes: float,
    *,
    rate_interval: str,
    now: float,
    dashboard: Path = DASHBOARD_JSON,
) -> list[dict[str, Any]]:
    """Fetch the main panels' queries for the last ``minutes`` and draw them."""
    items = [
        q for q in queries(load_dashboard(dashboard), rate_interval) if q["panel"] in MAIN_PANELS
    ]
    start = now - minutes * 60
    step = max(1.0, minutes * 60 / 300)
    fetched = fetch(get, items, start, now, step)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(now))
    render(fetched, png_path, f"SGLang fleet, last {minutes:g} min to {stamp}")
    return fetched


def _minutes(text: str) -> float:
    """--minutes: a finite number of minutes in (0, MAX_MINUTES]."""
    try:
        return float(typed_number.read(text, "--minutes", Range(0, MAX_MINUTES, low_open=True)))
    except typed_number.NumberError as exc:
        raise argparse.ArgumentTypeError(f"{exc.message} (minutes)") from None


def _rate_interval(text: str) -> str:
    """--rate-interval: a Prometheus duration longer than 0, as the whole string."""
    try:
        duration_ms(text, "--rate-interval", positive=True)
    except SettingError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="e.g. http://gateway:9090")
    parser.add_argument("--minutes", type=_minutes, default=30.0)
    parser.add_argument(
        "--rate-interval", type=_rate_interval, default="1m", help="stands for $__rate_interval"
    )
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD_JSON)
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    try:
        snapshot(
            http_getter(args.prometheus),
            args.png,
            args.minutes,
            rate_interval=args.rate_interval,
            now=time.time(),
            dashboard=args.dashboard,
        )
    except (OSError, ValueError, DashboardError) as exc:
        print(f"dashboard: {redact_url(exc)}", file=sys.stderr)
        return 1
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
