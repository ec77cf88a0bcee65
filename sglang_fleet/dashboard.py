"""The fleet dashboard's queries, and a PNG of its main panels from Prometheus's HTTP API.

    python -m sglang_fleet.dashboard --prometheus http://gateway:9090 OUT.png [--minutes 30]

For operators without a Grafana (it is not in Debian): the dashboard JSON the monitoring role
provisions (roles/monitoring/files/sglang-fleet-dashboard.json) is the one source of queries;
this module reads them, asks Prometheus for each over a time range (/api/v1/query_range) and
draws the main panels with matplotlib, like sglang_fleet.report draws a smoke run. The same
queries are what the tests check: each parses (promtool) and returns data in the monitoring
scenario (docs/MONITORING.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DASHBOARD = Path(__file__).resolve().parent.parent / "roles" / "monitoring" / "files"
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

Getter = Callable[[str, dict[str, str]], dict[str, Any]]


def load_dashboard(path: Path = DASHBOARD_JSON) -> dict[str, Any]:
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def queries(dashboard: dict[str, Any], rate_interval: str = "1m") -> list[dict[str, str]]:
    """Every query of every panel: [{panel, expr, legend}], Grafana's variable filled in."""
    return [
        {
            "panel": panel["title"],
            "expr": target["expr"].replace(RATE_INTERVAL, rate_interval),
            "legend": target.get("legendFormat", ""),
        }
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def http_getter(base_url: str, timeout: float = 30.0) -> Getter:
    """GET base_url + path?params from Prometheus's HTTP API; the JSON body's ``data``."""

    def get(path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"{base_url.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus answered {body.get('error', body)} for {url}")
        return body["data"]

    return get


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
        series = [
            (
                legend(item["legend"], s["metric"]),
                [float(t) - end for t, _ in s["values"]],
                [float(v) for _, v in s["values"]],
            )
            for s in data["result"]
        ]
        fetched.append({**item, "series": series})
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="e.g. http://gateway:9090")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate-interval", default="1m", help="stands for $__rate_interval")
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
    except (OSError, RuntimeError) as exc:
        print(f"dashboard: {exc}", file=sys.stderr)
        return 1
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
