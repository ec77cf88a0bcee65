"""The autotune report's picture: throughput per trial, what was pruned and why, the winner.

Two panels from an autotune state (sglang_fleet.tuning.autotune_state): output tok/s of every trial
in the order they ran (colour = outcome, a cross = what the planner predicted, the winner outlined),
and every candidate's predicted tok/s coloured by what became of it (tried, pruned by
reason, left untried by the early stop). The headline names the winner and why the search
stopped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import StrMethodFormatter

PANEL_TRIALS = "Output tokens/s per trial"
PANEL_CANDIDATES = "Candidates: predicted tokens/s and what became of them"
OUTCOME_COLORS = {"ok": "#2ca02c", "slo_miss": "#ff7f0e", "failed": "#d62728"}
STATUS_COLORS = {
    "tried": "#1f77b4",
    "pending": "#bbbbbb",
    "oom_risk": "#d62728",
    "cannot_start": "#9467bd",
    "cannot_fit": "#8c564b",
}
OTHER_PRUNE_COLOR = "#e377c2"
WINNER_EDGE = "black"
HEADROOM = 1.25


def render_png(
    state: Mapping[str, Any], png_path: str | Path, best: Mapping[str, Any] | None
) -> Figure:
    """Draw the state as a PNG at png_path; returns the figure (its axes carry titles).

    best: the search's winner (sglang_fleet.tuning.trial_choice.winner), None when no trial
    qualified.
    """
    figure = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(_headline(state, best), fontsize=11, ha="left", x=0.01, fontfamily="monospace")
    top, bottom = figure.subplots(2, 1)
    _trials_panel(top, state, best)
    _candidates_panel(bottom, state)
    figure.savefig(png_path, format="png")
    return figure


def _headline(state: Mapping[str, Any], best: Mapping[str, Any] | None) -> str:
    work = state["workload"]
    first = (
        f"winner: trial {best['n']} ({best['candidate']}) "
        f"{best['output_throughput']:,.0f} tok/s  "
        + ", ".join(f"{k}={v}" for k, v in best["tuned"].items())
        if best
        else "winner: none (no trial met the SLOs)"
    )
    second = (
        f"{state['server']}: {len(state['trials'])} trials of {len(state['candidates'])} "
        f"candidates; {work['num_prompts']} x {work['input_len']} in / {work['output_len']} out, "
        f"{work['concurrency']} concurrent"
    )
    return f"{first}\n{second}\n{state.get('stop_reason') or 'search not finished'}"


def _trials_panel(ax: Axes, state: Mapping[str, Any], best: Mapping[str, Any] | None) -> None:
    ax.set_title(PANEL_TRIALS, loc="left")
    ax.set_xlabel("trial")
    ax.set_ylabel("output tokens/s")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    trials = state["trials"]
    if not trials:
        _empty(ax, "no trial ran")
        return
    numbers = [t["n"] for t in trials]
    heights = [t.get("output_throughput") or 0.0 for t in trials]
    colors = [OUTCOME_COLORS.get(t["outcome"], "#777777") for t in trials]
    edges = [WINNER_EDGE if best and t["n"] == best["n"] else "none" for t in trials]
    ax.bar(numbers, heights, width=0.6, color=colors, edgecolor=edges, linewidth=2)
    predicted = [(t["n"], (t.get("predicted") or {}).get("output_tok_s")) for t in trials]
    shown = [(n, p) for n, p in predicted if p]
    if shown:
        ax.scatter(*zip(*shown, strict=True), marker="x", color="black", zorder=3)
    for trial in trials:
        label = trial["candidate"] + (" OOM" if trial.get("oom") else "")
        ax.annotate(
            label,
            xy=(trial["n"], trial.get("output_throughput") or 0.0),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(numbers)
    ax.set_ylim(0, max([*heights, *(p for _n, p in shown), 1.0]) * HEADROOM)
    handles: list[Any] = [Patch(color=c, label=o) for o, c in OUTCOME_COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor=WINNER_EDGE, linewidth=2, label="winner"))
    handles.append(Line2D([], [], marker="x", linestyle="none", color="black", label="predicted"))
    ax.legend(handles=handles, loc="upper right", ncols=5, fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _status(candidate: Mapping[str, Any]) -> str:
    if candidate["status"] == "pruned":
        return candidate["prune"]["code"]
    return candidate["status"]


def _candidates_panel(ax: Axes, state: Mapping[str, Any]) -> None:
    ax.set_title(PANEL_CANDIDATES, loc="left")
    ax.set_xlabel("candidate (in grid order)")
    ax.set_ylabel("predicted output tokens/s")
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    groups: dict[str, list[tuple[int, float]]] = {}
    for index, candidate in enumerate(state["candidates"]):
        predicted = (candidate.get("predicted") or {}).get("output_tok_s") or 0.0
        groups.setdefault(_status(candidate), []).append((index, predicted))
    if not groups:
        _empty(ax, "no candidates")
        return
    for status, points in sorted(groups.items()):
        xs, ys = zip(*points, strict=True)
        color = STATUS_COLORS.get(status, OTHER_PRUNE_COLOR)
        label = {"pending": "not tried (early stop)"}.get(status, status.replace("_", " "))
        ax.bar(xs, ys, color=color, label=f"{label} ({len(points)})")
    ax.set_ylim(0, ax.get_ylim()[1] * HEADROOM)
    ax.legend(loc="upper right", ncols=3, fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="#777777")
    ax.set_xticks([])
    ax.set_yticks([])
