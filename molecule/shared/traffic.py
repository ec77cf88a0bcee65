"""Steady client traffic through SGLang's router during a rollout, and the router's capacity.

Test infrastructure for the fleet and staging scenarios (standard library only: it runs with a
test host's own python3; molecule/shared/traffic_unit.py starts it there). Worker threads send
non-streaming /generate requests through the router, one after the other, each asking for
exactly --tokens tokens; a request counts as failed when it raises, answers anything but 200, or
returns a different number of completion tokens (a short answer is a failure, as in the smoke
client). A sampler reads the router's /readiness every --sample-every seconds: healthy_workers
of total_workers (0 when it answers 503 or not at all).

It stops at the first of: the stop file exists, --max-seconds passed, --max-requests sent. Then
it writes one JSON document to --out (written to a temporary name, then renamed, so a reader
never sees half of it):

    {"requests": N, "failed": F, "failures": [first 20 {t, status, tokens, error}],
     "tokens": {"expected": T, "short": S}, "elapsed_s": E, "samples": [[t, healthy, total], ...],
     "min_healthy": H, "stopped_by": "stop_file" | "max_seconds" | "max_requests"}

    python3 traffic.py --url http://gateway:8080 --key-file KEY --out traffic.json \
        --stop-file traffic.stop [--threads 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_FAILURES_KEPT = 20


@dataclass
class Tally:
    """What the worker threads and the sampler record; one lock guards it."""

    requests: int = 0
    failed: int = 0
    short: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    samples: list[list[float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_ticket(self, max_requests: int) -> bool:
        with self.lock:
            if self.requests >= max_requests:
                return False
            self.requests += 1
            return True

    def fail(self, record: dict[str, Any], short: bool = False) -> None:
        with self.lock:
            self.failed += 1
            self.short += int(short)
            if len(self.failures) < MAX_FAILURES_KEPT:
                self.failures.append(record)


def _headers(key: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def one_request(url: str, key: str, tokens: int, timeout: float) -> dict[str, Any]:
    """One /generate through the router: {status, tokens, error}."""
    body = {
        "text": "The fleet rolls one replica at a time.",
        "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True},
    }
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(body).encode(), headers=_headers(key), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read().decode())
            got = int((answer.get("meta_info") or {}).get("completion_tokens", -1))
            return {"status": response.status, "tokens": got, "error": None}
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:200]
        return {"status": err.code, "tokens": None, "error": detail or err.reason}
    except (OSError, ValueError) as err:
        return {"status": None, "tokens": None, "error": f"{type(err).__name__}: {err}"}


def worker(args: argparse.Namespace, key: str, tally: Tally, stop: threading.Event) -> None:
    start = time.monotonic()
    while not stop.is_set() and tally.take_ticket(args.max_requests):
        sent = time.monotonic() - start
        result = one_request(args.url, key, args.tokens, args.request_timeout)
        if result["status"] != 200 or result["tokens"] != args.tokens:
            short = result["status"] == 200
            tally.fail({"t": round(sent, 2), **result}, short=short)


def readiness(url: str, timeout: float) -> tuple[int, int]:
    """(healthy_workers, total_workers) from the router's /readiness; (0, 0) without an answer."""
    try:
        with urllib.request.urlopen(f"{url}/readiness", timeout=timeout) as response:
            answer = json.loads(response.read().decode())
    except urllib.error.HTTPError as err:  # 503: no healthy worker
        try:
            answer = json.loads(err.read().decode())
        except ValueError:
            return 0, 0
    except (OSError, ValueError):
        return 0, 0
    return int(answer.get("healthy_workers", 0)), int(answer.get("total_workers", 0))


def sampler(args: argparse.Namespace, tally: Tally, stop: threading.Event) -> None:
    start = time.monotonic()
    while not stop.is_set():
        healthy, total = readiness(args.url, args.request_timeout)
        with tally.lock:
            tally.samples.append([round(time.monotonic() - start, 2), healthy, total])
        stop.wait(args.sample_every)


def run(args: argparse.Namespace) -> dict[str, Any]:
    key = Path(args.key_file).read_text().strip() if args.key_file else ""
    tally, stop = Tally(), threading.Event()
    threads = [
        threading.Thread(target=worker, args=(args, key, tally, stop), daemon=True)
        for _ in range(args.threads)
    ]
    threads.append(threading.Thread(target=sampler, args=(args, tally, stop), daemon=True))
    start = time.monotonic()
    for thread in threads:
        thread.start()
    stopped_by = "max_requests"
    while any(t.is_alive() for t in threads[:-1]):
        if args.stop_file and os.path.exists(args.stop_file):
            stopped_by = "stop_file"
            break
        if time.monotonic() - start >= args.max_seconds:
            stopped_by = "max_seconds"
            break
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(args.request_timeout + 5)
    return {
        "requests": tally.requests,
        "failed": tally.failed,
        "failures": tally.failures,
        "tokens": {"expected": args.tokens, "short": tally.short},
        "elapsed_s": round(time.monotonic() - start, 2),
        "samples": tally.samples,
        "min_healthy": min((s[1] for s in tally.samples), default=None),
        "stopped_by": stopped_by,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the router, http://host:port")
    parser.add_argument("--key-file", default="", help="file holding the router's API key")
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop-file", default="")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-requests", type=int, default=50_000)
    parser.add_argument("--max-seconds", type=float, default=900)
    parser.add_argument("--sample-every", type=float, default=0.25)
    parser.add_argument("--request-timeout", type=float, default=60)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    partial = Path(f"{args.out}.partial")
    partial.write_text(json.dumps(result))
    partial.replace(args.out)


if __name__ == "__main__":
    main()
