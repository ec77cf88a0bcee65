"""The command line: the flags (named as SGLang's bench_serving names them), the
configuration checked before any request, the result JSON written, and ``main`` with
its exit statuses."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

from sglang_fleet.smoke.smoke_client.benchmark import Benchmark
from sglang_fleet.smoke.smoke_client.failures import ServerUnreachable, os_reason
from sglang_fleet.smoke.smoke_client.http_client import api_key_problem, split_url
from sglang_fleet.smoke.smoke_client.summary import format_summary
from sglang_fleet.smoke.smoke_client.workload import (
    MAX_TOKENS_PER_REQUEST,
    Config,
    VocabularyUnknown,
    parse_lengths,
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _token_count(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_TOKENS_PER_REQUEST:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_TOKENS_PER_REQUEST} tokens per request, got {text!r}"
        )
    return value


def _positive_number(text: str, allow_inf: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _positive_number(text)


def _rate(text: str) -> float:
    return _positive_number(text, allow_inf=True)


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _lengths(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return parse_lengths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Smoke throughput benchmark for an SGLang server (standard library only).",
        epilog="Prefer the SGLANG_API_KEY environment variable to --api-key: the command line "
        "of a process is visible to every user of the host.",
    )
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:30000", help="server base URL")
    add("--backend", choices=("sglang", "sglang-oai"), default="sglang",
        help="sglang: /generate with token ids; sglang-oai: /v1/completions with text")  # fmt: skip
    add("--num-prompts", type=_positive_int, default=None,
        help="requests to send (default 1000, or no limit with --duration)")  # fmt: skip
    add("--duration", type=_positive_float, default=None,
        help="send requests for this many seconds instead of a fixed count")  # fmt: skip
    add("--max-concurrency", type=_positive_int, default=None, help="requests in flight at most")
    add("--request-rate", type=_rate, default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)")  # fmt: skip
    add("--random-input-len", type=_token_count, default=1024, help="prompt tokens per request")
    add("--random-output-len", type=_token_count, default=128,
        help="output tokens per request; an answer with another count fails")  # fmt: skip
    add("--lengths", type=_lengths, default=None, metavar="I:O,...",
        help="a job's shape: prompt and output tokens of each request in turn (python -m "
        "sglang_fleet.job shape prints it); instead of --random-input-len/-output-len")  # fmt: skip
    add("--seed", type=_whole_number, default=42, help="workload seed (same seed, same requests)")
    add("--warmup-requests", type=_whole_number, default=1,
        help="requests sent first and not counted")  # fmt: skip
    add("--api-key", default=None, help="bearer token (default: $SGLANG_API_KEY)")
    add("--model", default=None, help="model name for sglang-oai (default: the server's first)")
    add("--slo-ttft-ms", type=_positive_float, default=None, help="TTFT SLO for goodput")
    add("--slo-tpot-ms", type=_positive_float, default=None, help="TPOT SLO for goodput")
    add("--metrics-interval", type=_positive_float, default=0.5,
        help="seconds between /metrics samples")  # fmt: skip
    add("--timeout", type=_positive_float, default=600.0, help="seconds allowed per request")
    add("--vocab-size", type=_positive_int, default=None,
        help="draw token ids below this (default: from the model /model_info names)")  # fmt: skip
    add("--json", dest="json_out", default=None, help="write the result JSON here")
    return parser


def _api_key(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """--api-key, else $SGLANG_API_KEY; refused (never printed) when a header cannot carry it."""
    source = "--api-key" if args.api_key else "SGLANG_API_KEY"
    key = args.api_key or os.environ.get("SGLANG_API_KEY") or None
    problem = api_key_problem(key) if key else None
    if problem:
        parser.error(f"the API key from {source} {problem}; the key itself is not shown")
    return key


def _check_json_path(path: str, parser: argparse.ArgumentParser) -> None:
    """Fail before the run, not after minutes of benchmarking, when the result cannot be kept."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        parser.error(f"--json {path!r} is a directory; name a file")
    if not os.path.isdir(folder):
        parser.error(f"--json {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"--json {path!r}: the folder {folder!r} is not writable")


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    if args.warmup_requests < 0:
        parser.error("--warmup-requests must not be negative")
    unbounded = math.isinf(args.request_rate) and args.max_concurrency is None
    if args.duration is not None and unbounded:
        parser.error("--duration needs --max-concurrency or a finite --request-rate")
    num_prompts = args.num_prompts
    if num_prompts is None and args.duration is None:
        num_prompts = 1000
    try:
        split_url(args.url)
    except ValueError as err:
        parser.error(str(err))
    if args.json_out:
        _check_json_path(args.json_out, parser)
    return Config(
        url=args.url,
        backend=args.backend,
        num_prompts=num_prompts,
        duration=args.duration,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        seed=args.seed,
        warmup_requests=args.warmup_requests,
        api_key=_api_key(args, parser),
        model=args.model,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        metrics_interval=args.metrics_interval,
        timeout=args.timeout,
        vocab_size=args.vocab_size,
        lengths=args.lengths,
    )


def _write_json(path: str, result: dict[str, Any]) -> None:
    """Write atomically: the gate must never read half a result."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args, parser)
    try:
        result = asyncio.run(Benchmark(cfg).run())
    except ServerUnreachable as err:
        print(f"smoke: {err}", file=sys.stderr)
        return 1
    except VocabularyUnknown as err:
        print(f"smoke: error: {err}", file=sys.stderr)
        return 2
    if args.json_out:
        try:
            _write_json(args.json_out, result)
        except OSError as err:
            print(
                f"smoke: cannot write --json {args.json_out!r}: {os_reason(err)}", file=sys.stderr
            )
            return 2
    print(format_summary(result))
    return 0
