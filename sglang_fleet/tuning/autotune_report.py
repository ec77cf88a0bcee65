"""An autotune search's outputs: the report's table, the winner as an inventory profile, and
the files under reports/<host>/<server>/ (the picture is autotune_picture.py's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sglang_fleet.tuning.autotune_inputs import PER_RANK_CHUNK, SPACE_FLAGS
from sglang_fleet.tuning.trial_choice import winner


def profile_yaml(state: Mapping[str, Any], profile_name: str | None = None) -> str:
    """The winner as an inventory profile (sglang_server_profiles) to paste or commit."""
    best = winner(state)
    name = profile_name or f"{state['server']}-autotuned"
    if best is None:
        return f"---\n# autotune for {state['server']}: no trial met the SLOs; no profile.\n"
    keys = [
        "chunked_prefill_size" if k == PER_RANK_CHUNK else k
        for k in SPACE_FLAGS
        if k in state["space"]
    ]
    keys += list(best["tuned"])  # what replaced a deprecated spelling
    tuned = {k: best["flags"][k] for k in dict.fromkeys(keys) if k in best["flags"]}
    lines = [
        "---",
        f"# autotune for {state['server']}: trial {best['n']} of {len(state['trials'])}, "
        f"{best['output_throughput']:.1f} output tok/s",
        f"# on the workload {_workload_text(state['workload'])}.",
        "# Add the entry to sglang_server_profiles in the inventory and set the server's",
        "# profile to it. A server's own flags override its profile: drop these keys there.",
        "sglang_server_profiles:",
        f"  {name}:",
    ]
    lines += [f"    {key}: {_yaml_scalar(value)}" for key, value in tuned.items()]
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    if value is None:  # a flag the winner removes (no speculation over a server that has it)
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def _workload_text(work: Mapping[str, int]) -> str:
    return (
        f"{work['num_prompts']} requests of {work['input_len']} + {work['output_len']} tokens, "
        f"{work['concurrency']} concurrent"
    )


def _tuned_text(tuned: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in tuned.items()) or "(current flags)"


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def report_markdown(state: Mapping[str, Any]) -> str:
    """The report's table: trials, pruned candidates and why, the winner."""
    lines = [
        f"# autotune: {state['server']}",
        "",
        f"Workload: {_workload_text(state['workload'])}. SLOs: {json.dumps(state['slo'])}. "
        f"Tolerance {state['tolerance']:g}.",
        f"Stopped: {state['stop_reason'] or 'not yet'}.",
        "",
        "| trial | candidate | flags | predicted tok/s | output tok/s | p99 TTFT ms | "
        "p99 TPOT ms | failed | outcome |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in state["trials"]:
        predicted = (t.get("predicted") or {}).get("output_tok_s")
        lines.append(
            f"| {t['n']} | {t['candidate']} | {_tuned_text(t['tuned'])} | {_num(predicted)} | "
            f"{_num(t.get('output_throughput'))} | {_num(t.get('p99_ttft_ms'), '{:.0f}')} | "
            f"{_num(t.get('p99_tpot_ms'))} | {_num(t.get('failed'), '{}')} | "
            f"{t['outcome']}{' (OOM)' if t.get('oom') else ''} |"
        )
    pruned = [c for c in state["candidates"] if c["status"] == "pruned"]
    lines += ["", f"## Pruned before trying ({len(pruned)})", ""]
    lines += ["| candidate | flags | why |", "|---|---|---|"]
    lines += [
        f"| {c['id']} | {_tuned_text(c['tuned'])} | {c['prune']['code']}: {c['prune']['reason']} |"
        for c in pruned
    ]
    left = [c for c in state["candidates"] if c["status"] == "pending"]
    lines += ["", f"Not tried (predicted no better within the tolerance): {len(left)}.", ""]
    best = winner(state)
    lines.append(
        f"**Winner**: trial {best['n']} ({best['candidate']}), {_tuned_text(best['tuned'])}: "
        f"{best['output_throughput']:.1f} output tok/s."
        if best
        else "**Winner**: none (no trial met the SLOs)."
    )
    return "\n".join(lines) + "\n"


def write_report(state: Mapping[str, Any], out_dir: str | Path, stamp: str) -> dict[str, str]:
    """reports/<host>/<server>/autotune-<stamp>.{md,json,png} and the winner's profile YAML."""
    # matplotlib is imported only to draw (it is slow to import and the loop never draws).
    from sglang_fleet.tuning.autotune_picture import render_png  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / f"autotune-{stamp}.md",
        "json": out / f"autotune-{stamp}.json",
        "png": out / f"autotune-{stamp}.png",
        "profile": out / f"autotune-{stamp}-profile.yml",
    }
    paths["markdown"].write_text(report_markdown(state), encoding="utf-8")
    best = winner(state)
    summary = {k: v for k, v in state.items() if k != "context"} | {"winner": best}
    paths["json"].write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    paths["profile"].write_text(profile_yaml(state), encoding="utf-8")
    render_png(state, paths["png"], best)
    return {k: str(v) for k, v in paths.items()}
