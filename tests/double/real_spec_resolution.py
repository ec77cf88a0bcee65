"""Run by tests/double/test_contract_speculative.py with the SGLang reference venv's Python:
resolve flag sets with the real SGLang 0.5.23 `ServerArgs` (the same resolution the real
launcher runs before it logs server_args=) and print, per case, the resolved speculative fields
or the exception, and the warnings of `sglang.srt.arg_groups.speculative_hook`.

Usage: python real_spec_resolution.py CASES.json  (a {name: [flags...]} object); prints JSON.
Standard library and the installed sglang only: it runs in the reference venv, not the project's.
"""

from __future__ import annotations

import json
import logging
import sys

FIELDS = (
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "max_running_requests",
    "mem_fraction_static",
    "enable_mixed_chunk",
    "disable_overlap_schedule",
)
HOOK_LOGGER = "sglang.srt.arg_groups.speculative_hook"


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append([record.name, record.levelname, record.getMessage()])


def resolve(argv: list[str], collect: Collect) -> dict[str, object]:
    from sglang.srt.server_args import prepare_server_args  # noqa: PLC0415

    collect.records.clear()
    try:
        server_args = prepare_server_args(argv)
        server_args.resolve_once()
        resolved = server_args.resolved_dict()
        out: dict[str, object] = {name: resolved[name] for name in FIELDS}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["warnings"] = [r for r in collect.records if r[0] == HOOK_LOGGER]
    return out


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as handle:
        cases = json.load(handle)
    collect = Collect()
    hook = logging.getLogger(HOOK_LOGGER)
    hook.addHandler(collect)
    hook.setLevel(logging.INFO)
    results = {name: resolve(argv, collect) for name, argv in cases.items()}
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
