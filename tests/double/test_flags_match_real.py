"""gpusim's SGLang flag parser against the real SGLang 0.5.23 parser.

Two layers:
- always: the double's `python -m gpusim.sglang_server --help` against the committed flag table
  (gpusim/gpusim/flags/sglang-0.5.23.json), so a drift of gpusim's parser is caught anywhere;
- with the reference venv (scripts/sglang-reference-env.sh; path from SGLANG_REF_VENV): the
  committed table against a fresh dump of the real parser, and the double against the real
  parser on the same command lines (exit code and error line).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from gpusim import sglang_server

REPO = Path(__file__).resolve().parents[2]
GPUSIM_SRC = REPO / "gpusim"
PROBE_CACHE = REPO / ".cache" / "gpusim-real-probe"
FLAG_TABLE = GPUSIM_SRC / "gpusim" / "flags" / "sglang-0.5.23.json"
DUMPER_DIR = GPUSIM_SRC / "tools"
BUILD_HINT = (
    "build the SGLang reference venv with `scripts/sglang-reference-env.sh` "
    "(3 to 6 minutes, 2.4 GB), or point SGLANG_REF_VENV at one"
)
# Both sides format help at one width, so usage text can be compared line for line.
COLUMNS = "80"
# An option's invocation in --help ("  --tp-size TP_SIZE, --tensor-parallel-size TP_SIZE").
_INVOCATION = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)")
_OPTION = re.compile(r"(?:^|, )(--?[A-Za-z0-9][\w-]*)")
_CHOICES = re.compile(r"(--?[\w-]+) \[?\{([^}]*)\}")

# Runs inside the reference venv: the real parser, built and called exactly as
# `python -m sglang.launch_server` does (prepare_server_args), which starts nothing when argv
# fails to parse or asks for --help.
_REAL_PROBE = """
import contextlib, io, json, sys
import dump_sglang_flags  # gpusim/tools, through PYTHONPATH
from sglang.srt.server_args import prepare_server_args

def attempt(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            prepare_server_args(argv)
            code = "parsed"
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:
            code = "exception: %s: %s" % (type(exc).__name__, exc)
    return {"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}

cases = json.loads(sys.argv[2])
result = {
    "dump": dump_sglang_flags.dump(dump_sglang_flags.build_server_parser()),
    "cases": [attempt(argv) for argv in cases],
}
with open(sys.argv[1], "w") as handle:
    json.dump(result, handle)
"""


@dataclass(frozen=True)
class Outcome:
    """What a command line did: exit code, and the last line of stderr (argparse's error)."""

    code: int | str
    error_line: str
    usage_shown: bool


def flag_table() -> dict[str, Any]:
    return json.loads(FLAG_TABLE.read_text(encoding="utf-8"))


def double_env() -> dict[str, str]:
    # PYTHONPATH: `python -m` from the repository root would find its gpusim/ folder first.
    env = dict(os.environ, COLUMNS=COLUMNS, PYTHONPATH=str(GPUSIM_SRC))
    env.pop("GPUSIM_STATE_DIR", None)
    return env


def run_double(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpusim.sglang_server", *argv],
        capture_output=True,
        text=True,
        env=double_env(),
        timeout=60,
        check=False,
    )


class _Parsed(Exception):
    """The double's parser accepted the command line (it would start a server next)."""


def _refuse_launch(*_args: object) -> None:
    raise _Parsed


def parse_in_double(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Outcome:
    """`python -m gpusim.sglang_server ARGV` up to where it would start work, in this process.

    The same `main` the module runs (warning, parse, ValueError handling), without a
    subprocess per case: the launcher is replaced so an accepted command line starts nothing.
    """
    monkeypatch.setenv("COLUMNS", COLUMNS)
    monkeypatch.setattr(sglang_server, "Launcher", _refuse_launch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code: int | str = sglang_server.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else str(exc.code)
        except _Parsed:
            code = "parsed"
    return outcome(code, err.getvalue())


@cache
def double_help() -> str:
    result = run_double(["--help"])
    assert result.returncode == 0, result.stderr
    return result.stdout


def usage_of(help_text: str) -> str:
    """The usage block: everything up to the first blank line."""
    return help_text.split("\n\n", 1)[0] + "\n"


def options_in_help(help_text: str) -> set[str]:
    """Every option string the help lists (aliases included), e.g. --model-path and --model."""
    found: set[str] = set()
    for line in help_text.splitlines():
        match = _INVOCATION.match(line)
        if match:
            found.update(_OPTION.findall(match.group(1)))
    return found


def choices_in_usage(usage: str) -> dict[str, list[str]]:
    return {flag: choices.split(",") for flag, choices in _CHOICES.findall(usage)}


def table_options(table: dict[str, Any], *, hidden: bool) -> set[str]:
    return {
        option
        for action in table["actions"]
        if action["help_suppressed"] == hidden
        for option in action["option_strings"]
    }


def table_choices(table: dict[str, Any]) -> dict[str, list[str]]:
    """Choices by first option string, the one argparse shows in usage."""
    return {
        action["option_strings"][0]: [str(choice) for choice in action["choices"]]
        for action in table["actions"]
        if action["choices"] is not None and not action["help_suppressed"]
    }


def outcome(code: int | str, stderr: str) -> Outcome:
    lines = stderr.strip().splitlines()
    return Outcome(code, lines[-1] if lines else "", "usage: sglang serve [-h]" in stderr)


# --- always: the double against the committed table ------------------------------------------


def test_flag_table_is_the_pinned_sglang() -> None:
    table = flag_table()
    assert (table["sglang_version"], table["prog"]) == ("0.5.23", "sglang serve")
    dests = {action["dest"] for action in table["actions"]}
    # Flags the fleet's inventory uses, and one a newer SGLang removed (fails real launches).
    assert {"model_path", "tp_size", "kv_cache_dtype", "hicache_size", "api_key"} <= dests
    assert "--cuda-graph-max-bs" not in table_options(table, hidden=False)


def test_double_usage_matches_table() -> None:
    """Same flags, order, metavars, choices and required-ness as the real usage text."""
    assert usage_of(double_help()) == flag_table()["usage"]


def test_double_options_match_table() -> None:
    assert options_in_help(double_help()) == table_options(flag_table(), hidden=False)


def test_double_choices_match_table() -> None:
    assert choices_in_usage(usage_of(double_help())) == table_choices(flag_table())


def test_double_accepts_hidden_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags SGLang hides from --help still parse; an unknown flag would be 'unrecognized'."""
    table = flag_table()
    hidden = [
        action["option_strings"][0]
        for action in table["actions"]
        if action["help_suppressed"] and action["nargs"] is None and action["option_strings"]
    ]
    assert hidden, "0.5.23 has hidden valued flags (--forward-pass-metrics-*)"
    for flag in hidden:
        result = parse_in_double(["--model-path", "/nonexistent", flag], monkeypatch)
        assert result.code == 2
        assert result.error_line.endswith(f"argument {flag}: expected one argument")
        assert parse_in_double(["--model-path", "/x", flag, "v"], monkeypatch).code == "parsed"


# --- with the reference venv: the table and the double against the real parser ---------------


def reference_python() -> Path:
    venv = Path(os.environ.get("SGLANG_REF_VENV", REPO / ".cache" / "sglang-ref" / "venv"))
    venv = venv if venv.is_absolute() else REPO / venv
    # The build script writes .stamp last: without it the venv is half-built or failed.
    if not (venv / ".stamp").is_file():
        pytest.skip(f"no complete SGLang reference venv at {venv}: {BUILD_HINT}")
    return venv / "bin" / "python"


CONFIG_TEXT = "model-path: /nonexistent\nport: 31000\nno-such-key: 3\n"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config whose last key SGLang does not know: merged into argv, then 'unrecognized'."""
    path = tmp_path_factory.mktemp("sglang-config") / "server.yaml"
    path.write_text(CONFIG_TEXT, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cases(config_file: Path) -> dict[str, list[str]]:
    return {
        "help": ["--help"],
        "unknown flag": ["--model-path", "/nonexistent", "--bad-flag"],
        "unknown flag, no model": ["--bad-flag"],
        "bad choice": ["--model-path", "/nonexistent", "--kv-cache-dtype", "bogus"],
        "bad choice before --help": ["--kv-cache-dtype", "bogus", "--help"],
        "bad int": ["--model-path", "/nonexistent", "--tp-size", "eight"],
        # human_readable_int: suffixes are case-sensitive, IEC suffixes take no decimals.
        "bad size suffix": ["--model-path", "/nonexistent", "--context-length", "128K"],
        "decimal IEC size": ["--model-path", "/nonexistent", "--max-total-tokens", "1.5Mi"],
        "removed flag, now ambiguous": ["--model-path", "/nonexistent", "--cuda-graph-max-bs", "8"],
        "unknown config key": ["--config", str(config_file), "--port", "32000"],
    }


@pytest.fixture(scope="module")
def real(cases: dict[str, list[str]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the real parser (importing SGLang costs ~10 CPU-seconds) for every case."""
    python = reference_python()
    out = PROBE_CACHE / f"{probe_key(python, cases)}.json"
    if not out.is_file():
        run_real_probe(python, list(cases.values()), out)
    probe = json.loads(out.read_text(encoding="utf-8"))
    probe["by_name"] = dict(zip(cases, probe["cases"], strict=True))
    return probe


def probe_key(python: Path, cases: dict[str, list[str]]) -> str:
    """Everything the real parser's answers depend on; the temporary config's path is not."""
    digest = hashlib.sha256()
    stamp = python.parent.parent / ".stamp"
    digest.update(stamp.read_bytes() + str(stamp.stat().st_mtime_ns).encode())
    digest.update((_REAL_PROBE + CONFIG_TEXT + COLUMNS).encode())
    for source in sorted(DUMPER_DIR.glob("*.py")):
        digest.update(source.read_bytes())
    normalized = {
        name: ["<config>" if arg.endswith(".yaml") else arg for arg in argv]
        for name, argv in cases.items()
    }
    digest.update(json.dumps(normalized, sort_keys=True).encode())
    return digest.hexdigest()


def run_real_probe(python: Path, argvs: list[list[str]], out: Path) -> None:
    """The real parser on every command line, in one process; written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.tmp")
    env = dict(os.environ, COLUMNS=COLUMNS, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(DUMPER_DIR)
    subprocess.run(
        [str(python), "-c", _REAL_PROBE, str(partial), json.dumps(argvs)],
        env=env,
        timeout=240,
        check=True,
    )
    partial.replace(out)


@pytest.mark.slow
def test_committed_table_is_a_fresh_dump(real: dict[str, Any]) -> None:
    fresh, committed = real["dump"], flag_table()
    for table in (fresh, committed):
        table.pop("python_version")
    assert fresh == committed, (
        "regenerate: .cache/sglang-ref/venv/bin/python gpusim/tools/dump_sglang_flags.py "
        f"--output {FLAG_TABLE.relative_to(REPO)}"
    )


@pytest.mark.slow
def test_double_help_lists_the_real_options(real: dict[str, Any]) -> None:
    real_help = real["by_name"]["help"]
    assert real_help["code"] == 0
    assert options_in_help(double_help()) == options_in_help(real_help["stdout"])


@pytest.mark.slow
def test_double_choices_match_real(real: dict[str, Any]) -> None:
    real_choices = choices_in_usage(usage_of(real["by_name"]["help"]["stdout"]))
    double_choices = choices_in_usage(usage_of(double_help()))
    assert double_choices.keys() == real_choices.keys()
    unordered = {  # SGLang builds some choices from a set: their order changes run to run
        action["option_strings"][0]
        for action in flag_table()["actions"]
        if action["choices_unordered"]
    }
    for flag, choices in real_choices.items():
        if flag in unordered:
            assert sorted(double_choices[flag]) == sorted(choices), flag
        else:
            assert double_choices[flag] == choices, flag


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "unknown flag",
        "unknown flag, no model",
        "bad choice",
        "bad choice before --help",
        "bad int",
        "bad size suffix",
        "decimal IEC size",
        "removed flag, now ambiguous",
        "unknown config key",
    ],
)
def test_double_fails_like_real(
    real: dict[str, Any],
    cases: dict[str, list[str]],
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_case = real["by_name"][name]
    expected = outcome(real_case["code"], real_case["stderr"])
    assert expected.code == 2, real_case  # the real parser rejects every one of these
    assert parse_in_double(cases[name], monkeypatch) == expected


@pytest.mark.slow
def test_double_cli_fails_like_real(real: dict[str, Any], cases: dict[str, list[str]]) -> None:
    """One case end to end through `python -m gpusim.sglang_server` (exit status included)."""
    real_case = real["by_name"]["unknown flag"]
    result = run_double(cases["unknown flag"])
    expected = outcome(real_case["code"], real_case["stderr"])
    assert outcome(result.returncode, result.stderr) == expected
