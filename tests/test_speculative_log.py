"""A speculative start's log read for a calibration (sglang_fleet/capacity/server_log.py): each
rank logs its draft's weights and KV pool after the target's (docs/SPECULATIVE.md), and the
start's figures are the target's, so a record of a speculative start plans like one of the same
start without a draft."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpusim_helpers import FIXTURES, KIMI, Server, start_server

from sglang_fleet.capacity.server_log import parse_log

pytestmark = pytest.mark.slow
EAGLE3 = str(FIXTURES / "kimi-k2.5-eagle3")
FLAGS = ("--model-path", KIMI, "--tp-size", "8", "--mem-fraction-static", "0.85")


def _log(state_dir: Path, tmp_path: Path, servers: list[Server], *extra: str) -> str:
    server = start_server(state_dir, tmp_path, *FLAGS, *extra)
    servers.append(server)
    server.wait_ready(60)
    text = server.log()
    server.proc.terminate()
    server.proc.wait(30)
    return text


def test_the_drafts_lines_are_not_the_starts(
    state_dir: Path, tmp_path: Path, servers: list[Server]
) -> None:
    draft = ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE3,
             "--max-running-requests", "100")  # fmt: skip
    spec_text = _log(state_dir, tmp_path, servers, *draft)
    assert spec_text.count("Load weight begin") == 16  # 8 ranks, each the target then the draft
    spec = parse_log(spec_text)
    [first_begin] = [
        line for line in spec_text.splitlines() if "TP0]" in line and "Load weight begin" in line
    ][:1]
    assert f"avail mem={spec.pre_gib:.2f} GB" in first_begin  # the target's, not the draft's
    assert spec.kv_tokens is not None and spec.kv_size_gib is not None
    tokens_line = next(line for line in spec_text.splitlines() if "KV Cache is allocated" in line)
    assert f"#tokens: {spec.kv_tokens}," in tokens_line
    assert spec.post_gib < spec.pre_gib  # after both weights: what the pool is sized from
