"""Capacity planner: will a flag set fit, and what bounds its throughput?

    python3 -m sglang_fleet.capacity.planner --model-path DIR --tp-size 8 --mem-fraction-static
    0.88 \
        --kv-cache-dtype fp8_e4m3 --gpu-memory-mib 97887 --host-ram-gib 400 --gpu-count 8 \
        [--calibrate-from server.log] [--json]

`plan()` is the pure function behind it; the deploy's pre-flight (filter `sglang_plan`)
calls it with facts slurped from the host. Exit status: 0 no errors, 1 errors (the plan
does not fit), 2 bad usage: an input outside its range (NaN, infinite, negative, zero where
zero means nothing, see planner_inputs.py) or a model directory that cannot be read,
with one message on stderr naming the argument. plan() raises PlanInputError for the same
inputs, so the Ansible filter reports them as such.

This module is the entry and its command line: plan() hands a GPU server to gpu_planner.py
(memory model, out-of-memory risk) and its table of attention-DP layouts to layout_table.py,
a CPU server to cpu_planner.py (host RAM); planner_inputs.py types every input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sglang_fleet import input_files
from sglang_fleet.capacity import (
    calibration_apply,
    kv_cache,
    layout_table,
    logged_flags,
    speculative,
)
from sglang_fleet.capacity.cpu_planner import CpuPlanner
from sglang_fleet.capacity.gpu_planner import GpuPlanner
from sglang_fleet.capacity.model_config import ModelConfigError, read_model_dir
from sglang_fleet.capacity.planner_inputs import (
    ARG_DEFAULTS,
    DEVICES,
    HOST_KEYS,
    SPECULATION_RESET_MODES,
    PlanInputError,
    shown,
)
from sglang_fleet.module_utils import typed_number


def plan(model_config: dict, weight_bytes: int, args: dict, host: dict) -> dict:
    """Plan one flag set. Pure: every input is data (the pre-flight slurps it from the host).

    model_config: config.json as a dict; weight_bytes: safetensors index metadata.total_size;
    args: SGLang flag values by field name (tp_size, mem_fraction_static, ...) plus workload
    (avg_input_len, avg_output_len, per_request_tok_s) and calibration_log (log text);
    host: gpu_memory_mib, host_ram_gib, gpu_count. Raises PlanInputError on bad input.
    args device "cpu" plans a CPU server (host RAM and max_total_tokens; no GPU fact needed).
    """
    device = args.get("device", "cuda") if isinstance(args, dict) else "cuda"
    if device == "cpu":
        return CpuPlanner(model_config, weight_bytes, args, host).run()
    planner = GpuPlanner(model_config, weight_bytes, args, host)
    result = planner.run()
    if planner.args["plan_layouts"] and planner.dp == 1 and planner.tp > 1:
        rows = layout_table.layout_rows(model_config, weight_bytes, args, host, planner.tp)
        result["attention_dp_layouts"] = rows
        result["recommended_layout"] = layout_table.recommend(rows, planner.attn_dp)
    return result


# --- command line ----------------------------------------------------------------------
def _integer(text: str) -> int:
    """A flag's integer (plugins/module_utils/typed_number.py): argparse's int() would echo 5,000
    digits back; the range is the planner's (planner_inputs)."""
    try:
        return int(typed_number.read(text, "value", typed_number.Range(integer=True)))
    except typed_number.NumberError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _real(text: str) -> float:
    """A flag's number: finite (argparse's float() takes 'nan' and '1e999')."""
    try:
        return float(typed_number.read(text, "value"))
    except typed_number.NumberError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_plan_arguments(parser: argparse.ArgumentParser, *, model_required: bool) -> None:
    """The planner's flags (shared with diagnose, which plans the levers it suggests)."""
    parser.add_argument(
        "--model-path", required=model_required, help="model directory (config.json)"
    )
    parser.add_argument("--tp-size", type=_integer, default=None)
    parser.add_argument("--dp-size", type=_integer, default=None)
    parser.add_argument("--attn-dp-size", type=_integer, default=None, help="attention-DP ranks")
    parser.add_argument(
        "--enable-dp-attention",
        action="store_true",
        default=None,
        help="deprecated: --dp-size N --enable-dp-attention means --attn-dp-size N",
    )
    parser.add_argument("--cuda-graph-max-bs-decode", type=_integer, default=None)
    parser.add_argument("--mem-fraction-static", type=_real, default=None)
    parser.add_argument("--kv-cache-dtype", default=None, choices=sorted(kv_cache.KV_ELEM_BYTES))
    parser.add_argument("--enable-hierarchical-cache", action="store_true", default=None)
    parser.add_argument("--hicache-size", type=_real, default=None, help="GB per rank")
    parser.add_argument("--hicache-ratio", type=_real, default=None)
    parser.add_argument("--chunked-prefill-size", type=_integer, default=None)
    parser.add_argument("--max-running-requests", type=_integer, default=None)
    parser.add_argument("--context-length", type=_integer, default=None)
    parser.add_argument("--page-size", type=_integer, default=None)
    parser.add_argument(
        "--device", choices=DEVICES, default=None, help="cpu: plan host RAM (docs/CPU-SERVERS.md)"
    )
    parser.add_argument("--max-total-tokens", type=_integer, default=None)
    parser.add_argument(
        "--gpu-memory-mib", type=_real, default=None, help="per GPU, as nvidia-smi reports"
    )
    parser.add_argument("--host-ram-gib", type=_real, default=None)
    parser.add_argument("--gpu-count", type=_integer, default=None)
    parser.add_argument("--gpu-name", default=None, help="as nvidia-smi names it")
    parser.add_argument(
        "--gpu-memory-bandwidth-gbs",
        type=_real,
        default=None,
        help="per GPU, GB/s, for the decode roofline (default: a table of GPU models)",
    )
    parser.add_argument("--avg-input-len", type=_integer, default=None)
    parser.add_argument("--avg-output-len", type=_integer, default=None)
    parser.add_argument("--per-request-tok-s", type=_real, default=None)
    parser.add_argument(
        "--calibrate-from", metavar="LOG", default=None, help="server log of an earlier run"
    )
    parser.add_argument(
        "--calibration",
        metavar="JSON",
        default=None,
        help="calibration record(s) or the host's store file (sglang_fleet.capacity.calibration)",
    )
    parser.add_argument(
        "--logged-flag",
        metavar="NAME=VALUE",
        action="append",
        default=None,
        help="a flag the --calibrate-from run used that its log does not say (repeatable; "
        f"one of {', '.join(logged_flags.STATABLE)}); the flags above describe the plan",
    )
    parser.add_argument("--calibration-mode", choices=calibration_apply.MODES, default=None)
    add_speculative_arguments(parser)
    parser.add_argument("--sglang-version", default=None)
    parser.add_argument("--min-free-after-graph-gib", type=_real, default=None)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """SGLang's --speculative-* flags the planner reads, and the speed-up model's inputs
    (docs/SPECULATIVE.md)."""
    parser.add_argument(
        "--speculative-algorithm",
        default=None,
        help="EAGLE, EAGLE3, NEXTN, STANDALONE or NGRAM, as SGLang takes it",
    )
    parser.add_argument(
        "--speculative-draft-model-path",
        metavar="DIR",
        default=None,
        help="the draft model's directory (config.json and its safetensors index are read)",
    )
    for name in ("num-steps", "eagle-topk", "num-draft-tokens", "ngram-max-bfs-breadth"):
        parser.add_argument(f"--speculative-{name}", type=_integer, default=None)
    parser.add_argument(
        "--speculative-accept-length",
        type=_real,
        default=None,
        help="accepted tokens per verify (SGLang's accept len); default: the calibration log's",
    )
    parser.add_argument(
        "--job-concurrency",
        type=_integer,
        default=None,
        help="concurrent requests the job sends (what speculation's 48 reset caps)",
    )
    parser.add_argument(
        "--speculation-reset",
        choices=SPECULATION_RESET_MODES,
        default=None,
        help="speculation without --max-running-requests: warn (default) or refuse",
    )
    parser.add_argument(
        "--gpu-bf16-tflops",
        type=_real,
        default=None,
        help="peak dense BF16 TFLOPS per GPU for the speed-up model (default: a table)",
    )


def read_draft(args: dict[str, Any]) -> dict[str, Any]:
    """args with the draft's config.json and checkpoint bytes read from
    speculative_draft_model_path (what the pre-flight reads on the host)."""
    path = args.get("speculative_draft_model_path")
    if not path or speculative.algorithm_of(args) in (None, "NGRAM"):
        return args
    try:
        config, weight_bytes = read_model_dir(path)
    except ModelConfigError as exc:
        raise PlanInputError(str(exc), "speculative_draft_model_path") from exc
    return args | {
        "speculative_draft_config": config,
        "speculative_draft_weight_bytes": weight_bytes,
    }


def _logged_flag_words(words: list[str]) -> dict[str, str]:
    flags = {}
    for word in words:
        name, sep, value = word.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or not name or not value.strip():
            raise PlanInputError(f"must be NAME=VALUE, got {shown(word)}", "calibration_log_flags")
        flags[name] = value.strip()
    return flags


def split_namespace(ns: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(planner args, host facts) from parsed flags; reads the calibration log file."""
    values = vars(ns)
    args = {k: values[k] for k in ARG_DEFAULTS if k in values and values[k] is not None}
    for option, key, limit in (
        ("calibrate_from", "calibration_log", input_files.LOG_LIMIT),
        ("calibration", "calibration", input_files.JSON_LIMIT),
    ):
        if values.get(option):
            try:
                args[key] = input_files.read_text(values[option], limit, "")
            except ValueError as exc:
                raise PlanInputError(str(exc).strip(), key) from None
    if values.get("logged_flag"):
        args["calibration_log_flags"] = _logged_flag_words(values["logged_flag"])
    host = {k: values[k] for k in HOST_KEYS if values.get(k) is not None}
    return args, host


def _cpu_summary(result: dict[str, Any]) -> list[str]:
    d = result["details"]
    return [
        f"{d['architecture']} ({d['attention']}) on CPU, KV {d['kv_cache_dtype']}",
        f"cell size {result['cell_size_bytes']} B/token, "
        f"max_total_num_tokens {result['max_total_num_tokens']} "
        f"(fitting host RAM: {d['max_total_tokens_fitting']})",
        f"concurrent requests {result['max_concurrent_requests']}, "
        f"KV-bound output ~{result['kv_bound_output_tok_s']} tok/s "
        f"({d['per_request_tok_s']} tok/s per request, {d['per_request_tok_s_source']})",
        f"host RAM needed {d['host_ram_needed_gib']} GiB of {d['host_ram_gib']} GiB "
        f"(weights {d['weights_gib']}, KV {d['kv_pool_gib']}), left {result['headroom_gib']} GiB",
    ]


def _summary(result: dict[str, Any]) -> str:
    d = result["details"]
    if d.get("device") == "cpu":
        lines = _cpu_summary(result)
        lines += [f"ERROR {e['code']}: {e['message']}" for e in result["errors"]]
        lines += [f"WARNING {w['code']}: {w['message']}" for w in result["warnings"]]
        return "\n".join(lines)
    lines = [
        f"{d['architecture']} ({d['attention']}), KV {d['kv_cache_dtype']}, "
        f"mem_fraction_static {d['mem_fraction_static']} "
        f"(SGLang default {d['sglang_default_mem_fraction_static']})",
        f"cell size {result['cell_size_bytes']} B/token, "
        f"max_total_num_tokens {result['max_total_num_tokens']}",
        f"concurrent requests {result['max_concurrent_requests']}, "
        f"KV-bound output ~{result['kv_bound_output_tok_s']} tok/s "
        f"({d['per_request_tok_s']} tok/s per request, {d['per_request_tok_s_source']})",
        f"headroom outside the static pool {result['headroom_gib']} GiB, "
        f"HiCache host total {result['hicache_host_gib_total']} GiB",
        _roofline_line(result["decode_roofline"]),
    ]
    for row in result.get("attention_dp_layouts") or []:
        lines.append(
            f"attention DP {row['attn_dp_size']}: {row['weights_per_gpu_gib']} GiB weights/GPU, "
            f"{row['kv_tokens_per_rank']} KV tokens/rank x {row['kv_pools']} = "
            f"{row['total_kv_tokens']}, {row['max_concurrent_requests']} concurrent, "
            f"~{row['kv_bound_output_tok_s']} tok/s KV-bound, roofline "
            f"{row['decode_roofline_tok_s']} tok/s, OOM margin/rank "
            f"{row['oom_margin_gib_per_rank']} GiB"
            + (
                f" (cuda_graph_max_bs_decode {row['cuda_graph_max_bs_decode']})"
                if row["cuda_graph_max_bs_decode"]
                else ""
            )
            + (f" ERRORS {', '.join(row['errors'])}" if row["errors"] else "")
        )
    if result.get("recommended_layout"):
        lines.append(f"recommended: {result['recommended_layout']['reason']}")
    if result.get("speculative"):
        lines += speculative_lines(result["speculative"])
    lines += [f"ERROR {e['code']}: {e['message']}" for e in result["errors"]]
    lines += [f"WARNING {w['code']}: {w['message']}" for w in result["warnings"]]
    return "\n".join(lines)


def speculative_lines(section: dict[str, Any]) -> list[str]:
    """The plan's speculative section in words (the summary, the pre-flight's bounds line)."""
    found = section["settings"]
    lines = [
        f"speculative {found['algorithm']}: {found['num_steps']} steps, top-k "
        f"{found['eagle_topk']}, {found['num_draft_tokens']} draft tokens ({found['source']}); "
        f"max_running_requests {section['max_running_requests']}"
        + (" (SGLang's reset: not given)" if section["reset_to_48"] else "")
    ]
    draft = section.get("draft")
    if draft:
        lines.append(
            f"draft {draft['architecture']} ({draft['attention']}, {draft['layers']} layer(s)): "
            f"{draft['weights_per_gpu_gib']} GiB weights/GPU, KV budget +"
            f"{draft['budget_cell_bytes']} B/token (its own pool {draft['cell_bytes']} B/token, "
            f"{section.get('draft_kv_gib')} GiB), KV budget {section['kv_budget_cell_bytes']} "
            "B/token in all"
        )
    gain = section.get("speedup")
    if not gain:
        lines.append(f"speed-up: {section.get('speedup_reason')}")
        return lines
    where = "; ".join(f"{a}-{b}" for a, b in gain["pays_at_batches"]) or "none"
    lines.append(
        f"speed-up at accept length {section['accept_length']} "
        f"({section['accept_length_source']}): x{section['speedup_at_planned_concurrency']} at "
        f"the planned concurrency ({section['planned_output_tok_s_without']} -> "
        f"{section['planned_output_tok_s_with']} tok/s KV-bound)"
        + (
            f", x{section['speedup_at_job_concurrency']} at the job's"
            if "speedup_at_job_concurrency" in section
            else ""
        )
        + f"; pays at running batches {where} (of 1-{gain['scanned_to_batch']})"
        + f"; model: {section['model']}"
    )
    return lines


def _roofline_line(roof: dict[str, Any]) -> str:
    if roof.get("tok_s") is None:
        return f"decode roofline: {roof.get('reason')}"
    return (
        f"decode roofline {roof['tok_s']} tok/s at {roof['batch']} requests: "
        f"{roof['weight_gib_per_gpu']} GiB weights + {roof['kv_gib_per_gpu']} GiB KV per GPU "
        f"per step at {roof['bandwidth_gbs']:g} GB/s ({roof['bandwidth_source']})"
    )


# The command-line option behind each PlanInputError.argument that is not `--<name>`.
_CLI_OPTIONS = {
    "calibration_log": "--calibrate-from",
    "calibration_log_flags": "--logged-flag",
    "model_config": "--model-path",
    "weight_bytes": "--model-path",
}


def cli_message(exc: PlanInputError) -> str:
    """The error as argparse words it: `argument --tp-size: must be ...`."""
    if exc.argument is None:
        return exc.message
    option = _CLI_OPTIONS.get(exc.argument, "--" + exc.argument.replace("_", "-"))
    return f"argument {option}: {exc.message}"


def _plan_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    try:
        config, weight_bytes = read_model_dir(ns.model_path)
    except ModelConfigError as exc:
        raise PlanInputError(str(exc), "model_path") from exc
    args, host = split_namespace(ns)
    return plan(config, weight_bytes, read_draft(args), host)


def main(argv: list[str] | None = None) -> int:
    # No abbreviations: `--tp 8` meaning --tp-size today could mean another flag tomorrow.
    parser = argparse.ArgumentParser(
        prog="python3 -m sglang_fleet.capacity.planner",
        description=__doc__.splitlines()[0],
        allow_abbrev=False,
    )
    add_plan_arguments(parser, model_required=True)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    try:
        result = _plan_from_namespace(ns)
    except PlanInputError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {cli_message(exc)}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if ns.json else _summary(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
