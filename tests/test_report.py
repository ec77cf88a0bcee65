"""The smoke result picture: a real PNG with the four panels an operator reads."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from sglang_fleet.smoke import smoke_picture as report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def result_with(**overrides: Any) -> dict[str, Any]:
    samples = [
        {
            "t": 0.5 * i,
            "num_running_reqs": float(min(i, 8)),
            "num_queue_reqs": float(max(0, i - 8)),
            "token_usage": min(1.0, 0.1 * i),
            "gen_throughput": 900.0 + 10 * i,
        }
        for i in range(12)
    ]
    result: dict[str, Any] = {
        "backend": "sglang",
        "completed": 95,
        "failed": 5,
        "duration": 5.4,
        "output_throughput": 1234.5,
        "p99_ttft_ms": 250.0,
        "p99_tpot_ms": 12.5,
        "max_concurrency": 8,
        "request_rate": None,
        "random_input_len": 512,
        "random_output_len": 128,
        "goodput": 0.9,
        "timeline": [{"t": t, "output_tokens": 1000 + 50 * t} for t in range(6)],
        "server_metrics": {
            "generation_tokens_delta": 6400.0,
            "prompt_tokens_delta": 48640.0,
            "peak_num_running_reqs": 8.0,
            "peak_num_queue_reqs": 3.0,
            "peak_token_usage": 1.0,
            "max_total_num_tokens": 65536.0,
            "samples": samples,
        },
        "ttft_ms_all": [50.0 + i for i in range(95)],
        "itl_ms_all": [5.0 + (i % 7) for i in range(2000)] + [400.0],
        "errors": ["HTTP 500: boom"],
    }
    result.update(overrides)
    return result


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
    return width, height


def left_titles(figure: Any) -> list[str]:
    return [ax.get_title(loc="left") for ax in figure.axes if ax.get_title(loc="left")]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """One rendering shared by the tests that read it (drawing takes a while)."""
    out = tmp_path_factory.mktemp("report") / "run.png"
    return report.render_report(result_with(), out), out


def test_writes_a_png_with_the_four_panels(rendered: tuple[Any, Path]) -> None:
    figure, out = rendered
    width, height = png_size(out)
    assert (width, height) == (1300, 850)
    assert left_titles(figure) == [
        report.PANEL_THROUGHPUT,
        report.PANEL_SERVER,
        report.PANEL_TTFT,
        report.PANEL_ITL,
    ]
    headline = figure.get_suptitle()
    assert "1,234 tok/s" in headline
    assert "p99 TTFT 250 ms" in headline
    assert "failed 5/100 (5.0%)" in headline
    assert "goodput 90.0%" in headline


def test_panels_draw_the_data(rendered: tuple[Any, Path]) -> None:
    figure, _ = rendered
    throughput, server, ttft, itl = (ax for ax in figure.axes if ax.get_title(loc="left"))
    # one bar per second of the timeline; the last second is cut short (5.4 s run): rate scaled
    bars = throughput.patches
    assert len(bars) == 6
    assert bars[-1].get_width() == pytest.approx(0.4)
    assert bars[-1].get_height() == pytest.approx(1250 / 0.4)
    labels = {line.get_label() for line in server.get_lines()}
    assert {"running", "queued"} <= labels
    assert "peak running 8" in server.get_xlabel()
    # outliers beyond p99.5 are left out of the histogram range, and reported
    assert "2,001 values, max 400.0 ms" in itl.get_title(loc="right")
    assert "(1 above" in itl.get_title(loc="right")
    assert sum(patch.get_height() for patch in ttft.patches) == 95 - 1
    assert "(1 above" in ttft.get_title(loc="right")
    # median and p99 marked on both distributions
    for ax in (ttft, itl):
        assert [t.get_text().split()[0] for t in ax.texts] == ["p50", "p99"]


def test_without_metrics_or_completions_it_says_so(tmp_path: Path) -> None:
    out = tmp_path / "empty.png"
    figure = report.render_report(
        result_with(
            completed=0,
            failed=3,
            output_throughput=0.0,
            server_metrics=None,
            timeline=[],
            ttft_ms_all=[],
            itl_ms_all=[],
            goodput=None,
        ),
        out,
    )
    png_size(out)
    texts = [text.get_text() for ax in figure.axes for text in ax.texts]
    assert any("--enable-metrics" in text for text in texts)
    assert any("no completed requests" in text for text in texts)
    assert any("no tokens were streamed" in text for text in texts)
    assert "goodput" not in figure.get_suptitle()


def test_command_line(tmp_path: Path) -> None:
    source = tmp_path / "result.json"
    source.write_text(json.dumps(result_with()))
    out = tmp_path / "cli.png"
    assert report.main([str(source), str(out)]) == 0
    assert png_size(out) == (1300, 850)
