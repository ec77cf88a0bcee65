"""Tests for plugins/modules/sglang_flags_check.py.

The help parser is checked against help text that argparse itself prints for a parser shaped like
SGLang's (aliases, long choice lists, nargs forms, underscore spellings, hidden flags), compared
with that parser's own actions. The module runs end to end (as Ansible runs it: the file with an
arguments file) against a fake launch module built from the same parser, and against the
GPU-less double gpusim.sglang_server when it is present.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import load_plugin

ROOT = Path(__file__).resolve().parent.parent
MODULE_PATH = ROOT / "plugins" / "modules" / "sglang_flags_check.py"
GPUSIM = ROOT / "gpusim"


sfc = load_plugin("plugins/modules/sglang_flags_check.py")

# A stand-in for `python -m sglang.launch_server`: SGLang-like flags; if the arguments parse
# without --help it "starts a server" (writes the marker), which the check must never cause.
FAKE_LAUNCH = textwrap.dedent(
    """
    import argparse, os, sys

    KV = ["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"]
    BACKENDS = ["triton", "torch_native", "flex_attention", "fa3", "fa4", "flashinfer",
                "flashmla", "trtllm_mla", "cutedsl_mla", "trtllm_mha", "aiter", "wave",
                "intel_amx", "ascend", "intel_xpu"]

    def build_parser():
        parser = argparse.ArgumentParser(prog="sglang serve")
        parser.add_argument("--model-path", "--model", required=True)
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--kv-cache-dtype", choices=KV, default="auto")
        parser.add_argument("--attention-backend", choices=BACKENDS, help="x " * 40)
        parser.add_argument("--hicache-write-policy",
                            choices=["write_back", "write_through", "write_through_selective"])
        parser.add_argument("--enable-hierarchical-cache", "--enable_hierarchical_cache",
                            action="store_true", help="- starts with a dash on purpose")
        parser.add_argument("--hicache-size", type=int, default=0)
        parser.add_argument("--max_num_reqs", type=int, help="only an underscore spelling")
        parser.add_argument("--cuda-graph-bs", type=int, nargs="+")
        parser.add_argument("--lora-target-modules", nargs="*", choices=["q_proj", "all"])
        parser.add_argument("--model-checksum", nargs="?", const="auto")
        parser.add_argument("--gc-threshold", type=int, nargs=3)
        parser.add_argument("--enable-tf32", action=argparse.BooleanOptionalAction)
        parser.add_argument("--json-model-override-args", type=str, default="{}")
        parser.add_argument("--hidden-worker-id", type=int, help=argparse.SUPPRESS)
        group = parser.add_argument_group("Port", "  -- group description indented like options")
        group.add_argument("--port", type=int, default=30000)
        return parser

    if __name__ == "__main__":
        with open(os.environ["FAKE_RUNS"], "a") as runs:  # one line per import of "SGLang"
            runs.write(" ".join(sys.argv[1:]) + "\\n")
        args = build_parser().parse_args()
        with open(os.environ["FAKE_STARTED"], "w") as handle:
            handle.write(repr(args))
    """
)


def _fake_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "fake_launch"}
    exec(compile(FAKE_LAUNCH, "fake_launch", "exec"), namespace)  # same code as the module file
    return namespace


@pytest.fixture(params=[60, 200], ids=["narrow", "wide"])
def help_text(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", str(request.param))  # argparse wraps usage and help to it
    return _fake_namespace()["build_parser"]().format_help()


def _expected_counts(nargs: Any) -> tuple[int, int]:
    table = {None: (1, 1), "?": (0, 1), "+": (1, sfc.MANY), "*": (0, sfc.MANY), 0: (0, 0)}
    return table.get(nargs, (nargs, nargs))


def test_parse_help_matches_the_parsers_own_actions(help_text: str) -> None:
    parser = _fake_namespace()["build_parser"]()
    known = sfc.parse_help(help_text)
    expected_options = set()
    for action in parser._actions:
        if not action.option_strings or "--help" in action.option_strings:
            continue
        if action.help == argparse.SUPPRESS:
            continue
        for option in action.option_strings:
            expected_options.add(option)
            spec = known[option]
            assert spec.options == action.option_strings
            choices = [str(choice) for choice in action.choices] if action.choices else None
            assert spec.choices == choices, option
            assert (spec.min_values, spec.max_values) == _expected_counts(action.nargs), option
    assert set(known) == expected_options
    assert "--hidden-worker-id" not in known  # argparse.SUPPRESS hides it from --help


def test_parse_help_joins_choices_wrapped_over_lines() -> None:
    text = textwrap.dedent(
        """\
        usage: serve [-h] --model-path MODEL_PATH
                     [--kv-cache-dtype {auto,fp8_e5m2,fp8_e4m3}]

        options:
          -h, --help            show this help message and exit
          --kv-cache-dtype {auto,fp8_e5m2,fp8_e4m3,mxfp8,bf16,
                            bfloat16,nvfp4,fp4_mx_block16}
                                Data type for the KV cache.
          --model-path MODEL_PATH, --model MODEL_PATH
                                The path of the model weights.
                                --not-a-flag mentioned in help text.
        """
    )
    known = sfc.parse_help(text)
    assert sorted(known) == ["--kv-cache-dtype", "--model", "--model-path"]
    assert known["--kv-cache-dtype"].choices == [
        "auto",
        "fp8_e5m2",
        "fp8_e4m3",
        "mxfp8",
        "bf16",
        "bfloat16",
        "nvfp4",
        "fp4_mx_block16",
    ]


def test_static_problems_report_unknown_flags_counts_and_choices(help_text: str) -> None:
    known = sfc.parse_help(help_text)
    argv = [
        "--model-path", "/m",
        "--kv-cache-dtype", "fp8",
        "--mem-frac", "0.8",
        "--max-num-reqs", "4",
        "--trust-remote-code", "yes",
        "--gc-threshold", "1", "2",
        "--lora-target-modules", "q_proj", "v_proj",
        "--tp-size", "8",
    ]  # fmt: skip
    problems, passed, unlisted = sfc.static_problems(argv, known, "srv.flags")
    assert [group.flag for group in passed] == ["--model-path", "--tp-size"]
    assert [group.flag for group in unlisted] == ["--mem-frac", "--max-num-reqs"]
    by_flag = {problem["flag"]: problem for problem in problems}
    assert by_flag["--kv-cache-dtype"]["code"] == "bad_choice"
    assert by_flag["--kv-cache-dtype"]["message"] == (
        "srv.flags.kv_cache_dtype: 'fp8' is not a choice of --kv-cache-dtype; allowed: auto, "
        "fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, fp4_mx_block16"
    )
    assert "v_proj" in by_flag["--lora-target-modules"]["message"]
    assert "switch" in by_flag["--trust-remote-code"]["message"]
    assert "exactly 3 value(s)" in by_flag["--gc-threshold"]["message"]
    unknown = {g.flag: sfc._unknown(g, known, "srv.flags")["message"] for g in unlisted}
    assert "closest: --mem-fraction-static" in unknown["--mem-frac"]
    assert "this SGLang spells it --max_num_reqs" in unknown["--max-num-reqs"]


def test_parser_error_reads_argparse_messages() -> None:
    stderr = (
        "usage: sglang serve [-h] ...\n"
        "sglang serve: error: argument --tp-size/--tensor-parallel-size: invalid int value: 'x'\n"
    )
    assert sfc.parser_error(stderr) == (
        ["--tp-size", "--tensor-parallel-size"],
        "invalid int value: 'x'",
    )
    assert sfc.parser_error("Traceback (most recent call last):\n") is None


def test_documentation_matches_the_argument_spec() -> None:
    options = yaml.safe_load(sfc.DOCUMENTATION)["options"]
    assert set(options) == set(sfc.ARGUMENT_SPEC)
    for name, spec in sfc.ARGUMENT_SPEC.items():
        assert options[name]["type"] == spec["type"], name
        assert options[name].get("default") == spec.get("default"), name
    yaml.safe_load(sfc.EXAMPLES)
    yaml.safe_load(sfc.RETURN)


# --------------------------------------------------------------------------- end to end


def run_module(
    tmp_path: Path, argv: list[str], launch_module: str, env: dict[str, str]
) -> dict[str, Any]:
    """Run the module file the way Ansible does (an arguments file), return its JSON."""
    args = {
        "python": sys.executable,
        "launch_module": launch_module,
        "argv": argv,
        "variable_prefix": "sglang_server_instances[kimi].flags",
        "timeout": 60,
        "_ansible_check_mode": True,
    }
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    proc = subprocess.run(
        [sys.executable, str(MODULE_PATH), str(args_file)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **env},
    )
    result = json.loads(proc.stdout)
    assert bool(result.get("failed")) == (proc.returncode != 0)
    return result


@pytest.fixture
def fake_launch(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "fakepkg"
    package.mkdir()
    (package / "launch.py").write_text(FAKE_LAUNCH)
    return {
        "PYTHONPATH": str(tmp_path),
        "FAKE_STARTED": str(tmp_path / "STARTED"),
        "FAKE_RUNS": str(tmp_path / "RUNS"),
    }


def _runs(fake_launch: dict[str, str]) -> list[str]:
    return Path(fake_launch["FAKE_RUNS"]).read_text().splitlines()


def test_module_passes_a_good_flag_set_without_starting_anything(
    tmp_path: Path, fake_launch: dict[str, str]
) -> None:
    argv = ["--model-path", "/m", "--tp-size", "8", "--kv-cache-dtype", "fp8_e4m3"]
    result = run_module(tmp_path, argv, "fakepkg.launch", fake_launch)
    assert not result.get("failed"), result
    assert result["problems"] == []
    assert result["changed"] is False
    assert result["known_flags"] == 21  # option strings, aliases counted, hidden one not
    assert result["sglang_version"] is None  # no sglang package in this interpreter
    assert not Path(fake_launch["FAKE_STARTED"]).exists()
    # Importing SGLang takes seconds to minutes: a right flag set is read and parsed in one run.
    assert _runs(fake_launch) == [" ".join([*argv, "--help"])]


def test_module_reruns_the_parser_only_for_a_flag_set_with_problems(
    tmp_path: Path, fake_launch: dict[str, str]
) -> None:
    argv = ["--model-path", "/m", "--tp-size", "eight"]
    result = run_module(tmp_path, argv, "fakepkg.launch", fake_launch)
    assert result["failed"] is True
    assert [p["flag"] for p in result["problems"]] == ["--tp-size"]
    # The whole list (exit 2), the help text alone, then the parser without the bad flag.
    assert _runs(fake_launch) == [
        "--model-path /m --tp-size eight --help",
        "--help",
        "--model-path /m --tp-size eight --help",
        "--model-path /m --help",
    ]


def test_module_lists_every_problem_with_its_variable(
    tmp_path: Path, fake_launch: dict[str, str]
) -> None:
    argv = [
        "--model-path", "/m",
        "--mem-fraction-static", "abc",
        "--kv-cache-dtype", "fp9",
        "--mem-fraction", "0.5",
        "--tp-size", "eight",
        "--hidden-worker-id", "3",
        "--hicache-size", "48.5",
    ]  # fmt: skip
    result = run_module(tmp_path, argv, "fakepkg.launch", fake_launch)
    assert result["failed"] is True
    problems = {problem["variable"].rsplit(".", 1)[1]: problem for problem in result["problems"]}
    assert set(problems) == {
        "mem_fraction_static",
        "kv_cache_dtype",
        "mem_fraction",
        "tp_size",
        "hicache_size",
    }
    assert problems["kv_cache_dtype"]["code"] == "bad_choice"
    assert problems["mem_fraction"]["code"] == "unknown_flag"
    assert "closest: --mem-fraction-static" in problems["mem_fraction"]["message"]
    assert problems["mem_fraction_static"]["message"] == (
        "sglang_server_instances[kimi].flags.mem_fraction_static: SGLang rejects "
        "--mem-fraction-static abc: invalid float value: 'abc'"
    )
    assert "invalid int value: 'eight'" in problems["tp_size"]["message"]
    assert "invalid int value: '48.5'" in problems["hicache_size"]["message"]
    assert "5 problem(s)" in result["msg"]
    assert "sglang_server_instances[kimi].flags.tp_size" in result["msg"]
    # --hidden-worker-id is missing from --help (SUPPRESS) but exists: not reported.
    assert not Path(fake_launch["FAKE_STARTED"]).exists()


def test_module_fails_clearly_when_the_launch_module_is_missing(
    tmp_path: Path, fake_launch: dict[str, str]
) -> None:
    result = run_module(tmp_path, ["--model-path", "/m"], "fakepkg.nope", fake_launch)
    assert result["failed"] is True
    [problem] = result["problems"]
    assert problem["code"] == "parser_error"
    assert "fakepkg.nope --help` exited 1" in problem["message"]
    assert "No module named fakepkg.nope" in problem["message"]


@pytest.mark.slow
@pytest.mark.skipif(
    not (GPUSIM / "gpusim" / "sglang_server.py").exists(), reason="gpusim double not present"
)
def test_module_against_the_gpusim_double(tmp_path: Path) -> None:
    """The double mimics SGLang 0.5.23's real parser (its flag table comes from that wheel)."""
    argv = [
        "--model-path", "/models/tiny",
        "--tp-size", "8",
        "--kv-cache-dtype", "fp8",
        "--mem-fraction-static", "0.9x",
        "--enable-hierachical-cache",
        "--hicache-write-policy", "write_through",
    ]  # fmt: skip
    env = {"PYTHONPATH": str(GPUSIM)}
    result = run_module(tmp_path, argv, "gpusim.sglang_server", env)
    assert result["failed"] is True
    assert result["known_flags"] > 500  # SGLang 0.5.23 has about 550 option strings
    problems = {problem["code"]: problem for problem in result["problems"]}
    assert set(problems) == {"unknown_flag", "bad_choice", "bad_value"}
    assert "closest: --enable-hierarchical-cache" in problems["unknown_flag"]["message"]
    assert "fp8_e4m3" in problems["bad_choice"]["message"]
    assert "nvfp4" in problems["bad_choice"]["message"]  # the 0.5.21+ choice list
    assert problems["bad_value"]["variable"].endswith(".mem_fraction_static")
    assert "invalid float value: '0.9x'" in problems["bad_value"]["message"]


def test_words_no_command_line_carries_are_reported_per_flag_and_left_out() -> None:
    argv = ["--model-path", "/m\0", "--tp-size", "8", "--x\0", "1", "--chat-template", "é" * 70000]
    problems, kept = sfc.unpassable_words(argv, "srv.flags")
    assert kept == ["--tp-size", "8"]
    assert [(p["code"], p["variable"]) for p in problems] == [
        ("not_argv", "srv.flags.model_path"),
        ("not_argv", "srv.flags"),  # a flag name with a NUL names no variable of its own
        ("not_argv", "srv.flags.chat_template"),
    ]
    assert "140000 bytes long" in problems[2]["message"]  # é is two bytes in UTF-8
