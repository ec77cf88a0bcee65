"""The server's flag parsing fails and merges exactly like SGLang's argparse."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpusim.flags import build_parser, parse_server_args, using_generated_table
from gpusim_helpers import LLAMA


def test_kimi_job_flags_parse() -> None:
    argv = (
        f"--model-path {LLAMA} --trust-remote-code --tp-size 8 --mem-fraction-static 0.90 "
        "--kv-cache-dtype fp8_e4m3 --host 0.0.0.0 --port 8000 --num-continuous-decode-steps 4 "
        "--disable-custom-all-reduce --enable-hierarchical-cache --hicache-size 48 "
        "--hicache-write-policy write_through --hicache-io-backend kernel --log-level info"
    ).split()
    args = parse_server_args(argv)
    assert (args.tp_size, args.mem_fraction_static, args.kv_cache_dtype) == (8, 0.9, "fp8_e4m3")
    assert (args.hicache_size, args.enable_hierarchical_cache, args.port) == (48, True, 8000)


def test_defaults_match_sglang() -> None:
    args = parse_server_args(["--model-path", LLAMA])
    assert (args.host, args.port, args.mem_fraction_static) == ("127.0.0.1", 30000, None)
    assert (args.kv_cache_dtype, args.tp_size, args.log_level) == ("auto", 1, "info")


def test_unknown_flag_exits_2_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_server_args(["--model-path", LLAMA, "--tp-szie", "8"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: sglang serve ")
    assert err.rstrip().endswith("error: unrecognized arguments: --tp-szie 8")


def test_bad_choice_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_server_args(["--model-path", LLAMA, "--kv-cache-dtype", "fp4_e2m1"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    # fp4_e2m1 was a choice up to 0.5.15, gone in 0.5.21+.
    assert "argument --kv-cache-dtype: invalid choice: 'fp4_e2m1'" in err


def test_bad_type_and_missing_model_path_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_server_args(["--model-path", LLAMA, "--tp-size", "eight"])
    assert "argument --tp-size/--tensor-parallel-size: invalid int value: 'eight'" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_server_args(["--tp-size", "1"])
    assert "the following arguments are required: --model-path" in capsys.readouterr().err


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for flag in ("--mem-fraction-static", "--hicache-size", "--enable-metrics", "--api-key"):
        assert flag in out


def test_config_file_merges_and_cli_wins(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text(
        f"model-path: {LLAMA}\ntp-size: 2\nenable-metrics: true\nkv-cache-dtype: fp8_e4m3\n"
    )
    args = parse_server_args(["--config", str(config), "--tp-size", "4"])
    assert (args.model_path, args.tp_size) == (LLAMA, 4)
    assert args.enable_metrics is True and args.kv_cache_dtype == "fp8_e4m3"


def test_config_file_must_be_yaml(tmp_path: Path) -> None:
    config = tmp_path / "server.json"
    config.write_text("{}")
    with pytest.raises(ValueError, match="Config file must be YAML format"):
        parse_server_args(["--config", str(config)])


def test_config_bad_choice_fails_like_the_cli(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text(f"model-path: {LLAMA}\nhicache-write-policy: write_sometimes\n")
    with pytest.raises(SystemExit) as info:
        parse_server_args(["--config", str(config)])
    assert info.value.code == 2


def test_the_generated_sglang_table_is_shipped_and_used() -> None:
    # The package ships the real 0.5.23 parser's table; flags beyond the hand table parse.
    assert using_generated_table()
    args = parse_server_args(["--model-path", LLAMA, "--attention-backend", "fa3"])
    assert args.attention_backend == "fa3"
    assert args.cuda_graph_max_bs_decode is None


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--context-length", "128k", 128_000),
        ("--context-length", "262144", 262_144),
        ("--max-total-tokens", "1Mi", 1_048_576),
        ("--max-prefill-tokens", "25.6k", 25_600),
        ("--cuda-graph-prefill-max-context", "2Ki", 2048),
    ],
)
def test_token_counts_take_sglang_size_suffixes(flag: str, value: str, expected: int) -> None:
    """human_readable_int: SI (k, M, G, T) and IEC (Ki, Mi, Gi, Ti) suffixes."""
    args = parse_server_args(["--model-path", LLAMA, flag, value])
    assert getattr(args, flag[2:].replace("-", "_")) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("128K", "Invalid integer value: '128K'. Use a plain integer"),  # case-sensitive
        ("1.5Mi", "Decimals are not allowed with IEC suffixes like 'Mi'"),
    ],
)
def test_bad_token_counts_exit_2_with_sglang_message(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_server_args(["--model-path", LLAMA, "--context-length", value])
    assert info.value.code == 2
    assert f"error: argument --context-length: {message}" in capsys.readouterr().err
