"""One picture of a smoke benchmark result, for the operator who has to judge a rollout.

    python -m sglang_fleet.smoke.smoke_picture RESULT.json OUT.png

Four panels from the result JSON that ``sglang_fleet.smoke.smoke_client`` writes
(docs/CONTRACTS.md):
output tokens/s over the run (client count, server's own figure beside it), running and queued
requests with KV token usage sampled from /metrics, and the TTFT and ITL distributions with
their median and p99 marked. The headline carries the numbers the gate judges.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import StrMethodFormatter

from sglang_fleet.module_utils.bounded_file import read_regular
from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

# A smoke result: its distributions are capped at 10000 entries each (docs/CONTRACTS.md).
MAX_RESULT_BYTES = 64 * 1024 * 1024

PANEL_THROUGHPUT = "Output tokens/s over the run"
PANEL_SERVER = "Server load, sampled from /metrics"
PANEL_TTFT = "Time to first token"
PANEL_ITL = "Inter-token latency"

CLIENT_COLOR = "#1f77b4"
SERVER_COLOR = "#ff7f0e"
RUNNING_COLOR = "#2ca02c"
QUEUED_COLOR = "#d62728"
USAGE_COLOR = "#9467bd"
MUTED = "#777777"
HIST_BINS = 40
# Empty space above the lines, where the legend goes without hiding any of them.
HEADROOM = 1.25
# The histogram range stops at this percentile so that a few outliers do not squash the bulk.
HIST_RANGE_PERCENTILE = 99.5


def render_report(result: dict[str, Any], png_path: str | Path) -> Figure:
    """Draw the result as a PNG at ``png_path``; returns the figure (its axes carry titles)."""
    figure = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(_headline(result), fontsize=12, ha="left", x=0.01, fontfamily="monospace")
    grid = figure.subplots(2, 2)
    _throughput_panel(grid[0][0], result)
    _server_panel(grid[0][1], result.get("server_metrics"))
    _distribution_panel(grid[1][0], PANEL_TTFT, result.get("ttft_ms_all") or [], CLIENT_COLOR)
    _distribution_panel(grid[1][1], PANEL_ITL, result.get("itl_ms_all") or [], SERVER_COLOR)
    figure.savefig(png_path, format="png")
    return figure


def _headline(result: dict[str, Any]) -> str:
    completed, failed = result.get("completed", 0), result.get("failed", 0)
    total = completed + failed
    failure_rate = failed / total if total else 0.0
    concurrency = result.get("max_concurrency")
    rate = result.get("request_rate")
    workload = (
        f"{result.get('backend', '?')}  {total} requests x "
        f"{result.get('random_input_len', '?')} in / {result.get('random_output_len', '?')} out"
        f"  concurrency {concurrency if concurrency else 'unlimited'}"
        f"  rate {rate if rate else 'inf'}/s"
    )
    figures = (
        f"{result.get('output_throughput', 0.0):,.0f} tok/s   "
        f"p99 TTFT {result.get('p99_ttft_ms', 0.0):,.0f} ms   "
        f"p99 TPOT {result.get('p99_tpot_ms', 0.0):,.1f} ms   "
        f"failed {failed}/{total} ({failure_rate:.1%})"
    )
    if result.get("goodput") is not None:
        figures += f"   goodput {result['goodput']:.1%}"
    return f"{figures}\n{workload}"


def _throughput_panel(ax: Axes, result: dict[str, Any]) -> None:
    ax.set_title(PANEL_THROUGHPUT, loc="left")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("tokens/s")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    timeline = result.get("timeline") or []
    if timeline:
        seconds, rates, widths = _per_second(timeline, result.get("duration") or 0.0)
        ax.bar(
            seconds,
            rates,
            width=widths,
            align="edge",
            color=CLIENT_COLOR,
            alpha=0.35,
            label="client, per second",
        )
    mean = result.get("output_throughput")
    if mean:
        ax.axhline(mean, color=CLIENT_COLOR, linestyle="--", linewidth=1, label="run mean")
    samples = (result.get("server_metrics") or {}).get("samples") or []
    if samples:
        ax.plot(
            [s["t"] for s in samples],
            [s["gen_throughput"] for s in samples],
            color=SERVER_COLOR,
            linewidth=1,
            label="server gen_throughput",
        )
    if not timeline and not samples:
        _empty(ax, "no tokens were streamed")
        return
    ax.set_ylim(0, ax.get_ylim()[1] * HEADROOM)
    ax.legend(loc="upper right", ncols=3, fontsize=8)
    ax.grid(alpha=0.3)


def _per_second(
    timeline: list[dict[str, Any]], duration: float
) -> tuple[list[float], list[float], list[float]]:
    """Bucket starts, tokens/s and bucket widths; the last second of a run is usually cut
    short, so its count is divided by the part of it that the run lasted."""
    seconds = [float(point["t"]) for point in timeline]
    widths = [1.0] * len(timeline)
    if duration > seconds[-1]:
        widths[-1] = min(1.0, duration - seconds[-1])
    rates = [point["output_tokens"] / w for point, w in zip(timeline, widths, strict=True)]
    return seconds, rates, widths


def _server_panel(ax: Axes, server: dict[str, Any] | None) -> None:
    ax.set_title(PANEL_SERVER, loc="left")
    ax.set_xlabel("seconds since start")
    if not server or not server.get("samples"):
        _empty(ax, "no /metrics samples\n(start SGLang with --enable-metrics)")
        return
    samples = server["samples"]
    times = [s["t"] for s in samples]
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.plot(times, [s["num_running_reqs"] for s in samples], color=RUNNING_COLOR, label="running")
    ax.plot(times, [s["num_queue_reqs"] for s in samples], color=QUEUED_COLOR, label="queued")
    ax.set_ylabel("requests")
    peak = max(max(s["num_running_reqs"], s["num_queue_reqs"]) for s in samples)
    ax.set_ylim(0, max(1.0, peak) * HEADROOM)
    ax.grid(alpha=0.3)
    usage_ax = ax.twinx()
    usage = [s["token_usage"] for s in samples]
    usage_ax.fill_between(times, usage, color=USAGE_COLOR, alpha=0.15, label="KV token usage")
    usage_ax.set_ylim(0, max(1.0, *usage) * HEADROOM)
    usage_ax.set_ylabel("KV token usage", color=USAGE_COLOR)
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = usage_ax.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="upper right", ncols=3, fontsize=8)
    ax.set_xlabel(f"seconds since start\n{_server_note(server)}")


def _server_note(server: dict[str, Any]) -> str:
    parts = []
    if server.get("peak_num_running_reqs") is not None:
        parts.append(f"peak running {server['peak_num_running_reqs']:.0f}")
    if server.get("peak_num_queue_reqs") is not None:
        parts.append(f"queued {server['peak_num_queue_reqs']:.0f}")
    if server.get("peak_token_usage") is not None:
        parts.append(f"KV usage {server['peak_token_usage']:.0%}")
    if server.get("max_total_num_tokens"):
        parts.append(f"of {server['max_total_num_tokens']:,.0f} tokens")
    return ", ".join(parts)


def _distribution_panel(ax: Axes, title: str, values_ms: list[float], color: str) -> None:
    ax.set_title(title, loc="left")
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("count")
    if not values_ms:
        _empty(ax, "no completed requests")
        return
    ordered = sorted(values_ms)
    top = _percentile(ordered, HIST_RANGE_PERCENTILE)
    low = ordered[0]
    if top <= low:
        top = low + 1.0
    beyond = sum(1 for v in ordered if v > top)
    ax.hist(ordered, bins=HIST_BINS, range=(low, top), color=color, alpha=0.75)
    for pct, style in ((50, ":"), (99, "--")):
        value = _percentile(ordered, pct)
        ax.axvline(value, color="black", linestyle=style, linewidth=1)
        ax.annotate(
            f"p{pct} {value:,.1f}",
            xy=(value, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12 if pct == 50 else -26),
            textcoords="offset points",
            fontsize=8,
        )
    summary = f"{len(ordered):,} values, max {ordered[-1]:,.1f} ms"
    if beyond:
        summary += f" ({beyond:,} above {top:,.1f} not drawn)"
    ax.set_title(summary, loc="right", fontsize=8, color=MUTED)
    ax.grid(alpha=0.3)


def _percentile(ordered: list[float], pct: float) -> float:
    """numpy's default (linear) percentile of an already sorted list."""
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color=MUTED)
    ax.set_xticks([])
    ax.set_yticks([])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw a smoke benchmark result as a PNG.")
    parser.add_argument(
        "result", type=Path, help="result JSON from sglang_fleet.smoke.smoke_client --json"
    )
    parser.add_argument("png", type=Path, help="where to write the picture")
    args = parser.parse_args(argv)
    try:
        raw = read_regular(str(args.result), MAX_RESULT_BYTES)
        if raw is None:
            raise ValueError(f"{args.result} does not exist")
        result = bounded_loads(raw, str(args.result))
        if not isinstance(result, dict):
            raise ValueError(f"{args.result} is not a smoke result (a JSON object)")
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    render_report(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
