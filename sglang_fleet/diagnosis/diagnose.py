"""Bottleneck diagnosis of a run, or of a running server: what bounds it, what to change next.

    python3 -m sglang_fleet.diagnosis.diagnose [--log SERVER_LOG] [--smoke-result RESULT.json] \
        [--concurrency N] [--model-path DIR --gpu-memory-mib MIB ...] --json
    python3 -m sglang_fleet.diagnosis.diagnose --url http://HOST:PORT [--api-key-file F] [--window
    30] \
        [--json | --table] [--log SERVER_LOG] [--model-path DIR --gpu-memory-mib MIB ...]
    python3 -m sglang_fleet.diagnosis.diagnose --sample LIVE_SAMPLE.json [--json | --table] ...

After a run it reads what the smoke benchmark sampled from /metrics (`server_metrics.samples`,
see docs/CONTRACTS.md) and/or the server log's "Decode batch" lines. With --url it samples a
running server's /metrics for --window seconds without touching it
(sglang_fleet.diagnosis.live_metrics; with
--sample it reads such a sample taken on the GPU host) and judges that window the same way
(docs/DIAGNOSIS.md). It prints one JSON object: `verdict` (kv_cache_bound, compute_bound,
client_bound, healthy, idle; `unknown` when there is nothing to judge), `evidence` (the
numbers), `levers` (next steps, objects with code and message) and `notes`; a live diagnosis
adds `summary`, `row` and `server`. With a model (planner flags, or `plan_context` in the pure
functions) the levers carry the planner's expected capacity. Exit status: 0 with a diagnosis;
1 when a live server could not be sampled (unreachable, no --enable-metrics, API key refused);
2 on bad usage. The verdict itself never changes the exit status.

This module is the command line. The diagnosis itself, one job a module: evidence.py (samples,
evidence, verdict), levers.py (what to change), speculation.py (speculative decoding),
run_diagnosis.py (a finished run: `diagnose`) and live_diagnosis.py (a running server:
`diagnose_live`, `table_lines`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any
from urllib.parse import urlsplit

from sglang_fleet import input_files
from sglang_fleet.capacity.model_config import ModelConfigError, read_model_dir
from sglang_fleet.capacity.planner import add_plan_arguments, read_draft, split_namespace
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.diagnosis import live_metrics
from sglang_fleet.diagnosis.live_diagnosis import as_sample, diagnose_live, table_lines
from sglang_fleet.diagnosis.run_diagnosis import diagnose
from sglang_fleet.module_utils import bounded_json


# --- command line ----------------------------------------------------------------------
def _plan_context(ns: argparse.Namespace) -> dict[str, Any] | None:
    if not ns.model_path:
        return None
    config, weight_bytes = read_model_dir(ns.model_path)
    args, host = split_namespace(ns)
    args = read_draft(args)
    if "gpu_memory_mib" not in host:
        raise PlanInputError("--model-path needs --gpu-memory-mib to size the levers")
    return {"model_config": config, "weight_bytes": weight_bytes, "args": args, "host": host}


def _summary(result: dict[str, Any]) -> str:
    ev = result["evidence"]
    numbers = ", ".join(f"{k}={v}" for k, v in ev.items() if v is not None)
    lines = [f"verdict: {result['verdict']}", f"evidence: {numbers}"]
    lines += [f"lever {lv['code']}: {lv['message']}" for lv in result["levers"]]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.diagnosis.diagnose",
        description=__doc__.splitlines()[0],
        # An abbreviation would let "--api-key SECRET" pass as --api-key-file and print it.
        allow_abbrev=False,
    )
    parser.add_argument("--log", help="SGLang server log (Decode batch lines, start-up lines)")
    parser.add_argument(
        "--smoke-result",
        help="smoke benchmark result JSON (sglang_fleet.smoke.smoke_client --json)",
    )
    live_metrics.add_sampling_arguments(parser)
    parser.add_argument(
        "--sample",
        help="live sample JSON, as sglang_fleet/diagnosis/live_metrics.py writes it on a GPU host",
    )
    parser.add_argument("--concurrency", type=int, help="concurrency the client asked for")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--table", action="store_true", help="print the fleet table's row (live)")
    add_plan_arguments(parser, model_required=False)
    return parser


def _check_sources(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    if ns.url and ns.sample:
        parser.error("give --url or --sample, not both")
    is_live = bool(ns.url or ns.sample)
    if is_live and ns.smoke_result:
        parser.error("--smoke-result is a finished run: not with --url or --sample")
    if is_live and ns.concurrency is not None:
        parser.error("--concurrency is the benchmark client's: a live server has none")
    if not is_live and not ns.log and not ns.smoke_result:
        parser.error("give --url, --sample, or --log and/or --smoke-result")
    if not is_live and ns.table:
        parser.error("--table needs --url or --sample")


def _live_sample(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.sample:
        return as_sample(input_files.read_text(ns.sample, input_files.JSON_LIMIT, "--sample"))
    live_metrics.check_url(ns.url)
    live_metrics.check_window(ns.window, ns.interval)
    api_key = live_metrics.read_api_key(ns.api_key_file)
    try:
        return live_metrics.sample_server(ns.url, ns.window, ns.interval, api_key)
    except live_metrics.SampleError as exc:
        return live_metrics.error_sample(ns.url, exc.code, str(exc))


def _print_live(result: dict[str, Any], ns: argparse.Namespace) -> None:
    if ns.json:
        print(json.dumps(result, indent=2))
    elif ns.table:
        url = urlsplit(result["server"].get("url") or "")
        name = result["server"].get("served_model_name") or "-"
        entry = {"host": url.netloc or "-", "server": name, "diagnosis": result}
        print("\n".join(table_lines([entry])))
    else:
        print(result["summary"])
        if not result.get("error"):
            print(_summary(result))


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    ns = parser.parse_args(argv)
    _check_sources(parser, ns)
    try:
        log_text = input_files.read_text(ns.log, input_files.LOG_LIMIT, "--log") if ns.log else None
        smoke = (
            bounded_json.loads(
                input_files.read_text(ns.smoke_result, input_files.JSON_LIMIT, "--smoke-result"),
                "--smoke-result",
            )
            if ns.smoke_result
            else None
        )
        ctx = _plan_context(ns)
        sample = _live_sample(ns) if ns.url or ns.sample else None
    except (
        OSError,
        ValueError,  # JSON that does not parse, or is not an object
        ModelConfigError,
        PlanInputError,
        live_metrics.UsageError,
    ) as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if sample is None:
        result = diagnose(smoke, log_text, ns.concurrency, ctx)
        print(json.dumps(result, indent=2) if ns.json else _summary(result))
        return 0
    result = diagnose_live(sample, ctx, log_text)
    _print_live(result, ns)
    if result.get("error"):
        print(f"{parser.prog}: {result['error']['message']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
