"""Server /metrics (Prometheus text format): the project's one parser of it, also what
sglang_fleet/diagnosis/live_metrics.py reads a running server's metrics with."""

from __future__ import annotations

import math
import re

# Blanks (spaces or tabs) end the name; after a label set's "}" the value may follow at once.
_SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\}\s*|\s+)(\S+)")
# A label name starts at the first letter of a run of name characters (digits may come first):
# tried only where such a run starts, so a long run costs its length once, not its square.
_LABEL = re.compile(r'(?<![A-Za-z0-9_])[0-9]*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
# A sample line longer than this is skipped: /metrics lines are a few hundred characters, and
# the bound keeps what one line costs small.
MAX_LINE_CHARS = 64 * 1024


def parse_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample line as (name, labels, value); comments and values that are not finite
    numbers (NaN, +Inf, -Inf: legal Prometheus, but no count or gauge here; +Inf would reach a
    result file as JSON's Infinity) are skipped, and so are lines longer than MAX_LINE_CHARS. A
    timestamp after the value is ignored."""
    series = []
    for line in text.splitlines():
        if not line or line[0] == "#" or len(line) > MAX_LINE_CHARS:
            continue
        match = _SERIES.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        series.append((match.group(1), labels, value))
    return series


def parse_prometheus(text: str, left_out: set[str] | None = None) -> dict[str, float]:
    """Finite sample values by metric name, summed over label sets (one per tp/dp rank). A
    name whose sum runs past the largest float is left out (and added to left_out): a sum of
    finite counters must not reach a result as infinity, nor a difference of two as NaN."""
    totals: dict[str, float] = {}
    overflowed: set[str] = set()
    for name, _labels, value in parse_series(text):
        total = totals.get(name, 0.0) + value
        if math.isfinite(total):
            totals[name] = total
        else:
            overflowed.add(name)
    for name in overflowed:
        totals.pop(name, None)
    if left_out is not None:
        left_out.update(overflowed)
    return totals
