"""Tests for sglang_fleet/servers/launch_line.py: argv rendering and systemd quoting.

Quoting is checked twice: against a small model of systemd's parser written from systemd.syntax(7)
and systemd.service(5) (always runs), and for real (slow) by starting a unit in the Molecule
test-host image and comparing the argv and environment the process received.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_fleet.servers.launch_line import env_file_line, exec_start, systemd_quote, to_argv

HOSTILE = [
    "plain",
    "",
    " leading and trailing ",
    "it's",
    'say "hi"',
    "back\\slash",
    "ends with backslash\\",
    "\\",
    "100%",
    "%n %i %% %",
    "$HOME",
    "${HOME}",
    "$$",
    "$(id)",
    "`id`",
    ";",
    "\\;",
    "a;b",
    "&& rm -rf /",
    "tab\there",
    "new\nline",
    "plain-word-then-newline\n",  # `$` in a pattern matches before it: must not pass as bare
    "carriage\rreturn",
    "\x01\x1b[31m\x7f",
    "\x85 next-line",
    "ünïcødé €",
    "#not a comment",
    "-@:+!",
    "'",
    '"',
    "\\x25",
    "--flag=value",
    '{"rope_scaling":{"type":"yarn","factor":4.0}}',
]
# EnvironmentFile values cannot hold control characters other than TAB (see flags.py).
HOSTILE_ENV = [value for value in HOSTILE if not re.search(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]", value)]


# --------------------------------------------------------------------------- to_argv


def test_to_argv_renders_sglang_flags_in_stable_order() -> None:
    flags = {
        "tp_size": 8,
        "trust_remote_code": True,
        "disable_radix_cache": False,
        "chunked_prefill_size": None,
        "mem_fraction_static": 0.88,
        "kv_cache_dtype": "fp8_e4m3",
        "model_path": "/shared/kimi-k2.5-int4",
        "cuda_graph_bs_decode": [1, 2, 4.0],
        "json_model_override_args": {"rope_scaling": {"type": "yarn", "factor": 4.0}},
    }
    assert to_argv(flags) == [
        "--model-path",
        "/shared/kimi-k2.5-int4",
        "--cuda-graph-bs-decode",
        "1",
        "2",
        "4",
        "--json-model-override-args",
        '{"rope_scaling":{"factor":4.0,"type":"yarn"}}',
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--mem-fraction-static",
        "0.88",
        "--tp-size",
        "8",
        "--trust-remote-code",
    ]
    # Insertion order does not matter: a rerun renders the same unit.
    assert to_argv(dict(reversed(list(flags.items())))) == to_argv(flags)


@pytest.mark.parametrize(
    ("value", "word"),
    [
        (0.88, "0.88"),
        (0.9, "0.9"),
        (48.0, "48"),  # int flags reject "48.0"; float flags accept "48"
        (1e-05, "1e-05"),
        (2.5e20, "2.5e+20"),
        (30000, "30000"),
        ("0.88", "0.88"),
    ],
)
def test_numbers_render_without_float_noise(value: object, word: str) -> None:
    assert to_argv({"x": value}) == ["--x", word]
    assert float(word) == float(value)  # type: ignore[arg-type]


def test_dashed_keys_are_accepted_and_collide_with_their_snake_case_twin() -> None:
    assert to_argv({"mem-fraction-static": 0.9}) == ["--mem-fraction-static", "0.9"]
    with pytest.raises(ValueError, match="mem-fraction-static"):
        to_argv({"mem_fraction_static": 0.9, "mem-fraction-static": 0.8})


def test_empty_list_is_omitted_like_none() -> None:
    assert to_argv({"numa_node": [], "port": 8000}) == ["--port", "8000"]


@pytest.mark.parametrize(
    "key", ["Mem_fraction", "a b", "--port", "x;rm", "", "-x", "é", "a=b", "tp_size\n"]
)
def test_bad_keys_are_rejected_naming_the_key(key: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        to_argv({key: 1})
    assert repr(key) in str(excinfo.value)


def test_unrenderable_value_is_rejected() -> None:
    with pytest.raises(ValueError, match="set"):
        to_argv({"x": {1, 2}})


# --------------------------------------------------------------------------- a model of systemd


def _cunescape(text: str) -> str:
    simple = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
    simple |= {"\\": "\\", '"': '"', "'": "'", "s": " "}
    out, index = "", 0
    while index < len(text):
        char = text[index]
        if char != "\\":
            out, index = out + char, index + 1
            continue
        code = text[index + 1]
        if code in simple:
            out, index = out + simple[code], index + 2
        elif code == "x":
            out, index = out + chr(int(text[index + 2 : index + 4], 16)), index + 4
        elif code == "u":
            out, index = out + chr(int(text[index + 2 : index + 6], 16)), index + 6
        else:
            raise AssertionError(f"escape \\{code} is not one systemd knows")
    return out


def model_systemd_argv(line: str) -> list[str]:
    """ExecStart= words as systemd 252 reads them: split, unquote+unescape, %%, $$.

    Good enough for what systemd_quote emits (double-quoted words or plain characters): a
    quoted word must be followed by whitespace or the end of the line, like systemd wants.
    """
    words: list[str] = []
    for match in re.finditer(r'"((?:[^"\\]|\\.)*)"(?=\s|$)|([^\s"\'\\;]+)(?=\s|$)|(\S+)', line):
        quoted, bare, other = match.groups()
        assert other is None, f"systemd would read {other!r} differently"
        word = _cunescape(quoted) if quoted is not None else bare
        word = word.replace("%%", "\0")
        assert "%" not in word, f"unescaped specifier in {word!r}"
        word = word.replace("\0", "%").replace("$$", "\0")
        assert "$" not in word, f"unescaped variable in {word!r}"
        words.append(word.replace("\0", "$"))
    return words


@pytest.mark.parametrize("value", HOSTILE)
def test_each_hostile_value_stays_one_word(value: str) -> None:
    quoted = systemd_quote(value)
    assert "\n" not in quoted and "\r" not in quoted
    assert model_systemd_argv(quoted) == [value]


def test_exec_start_line_round_trips_through_the_model() -> None:
    argv = ["/opt/ml env/bin/python", "-m", "sglang.launch_server", *HOSTILE]
    line = exec_start(argv)
    assert line.startswith('"/opt/ml env/bin/python" -m sglang.launch_server ')
    assert model_systemd_argv(line) == argv


def test_plain_words_stay_readable() -> None:
    assert systemd_quote("/shared/kimi-k2.5-int4") == "/shared/kimi-k2.5-int4"
    assert systemd_quote("fp8_e4m3") == "fp8_e4m3"
    assert systemd_quote("%") == '"%%"'
    assert systemd_quote("$X") == '"$$X"'
    assert systemd_quote(";") == '";"'
    assert systemd_quote("a\nb") == '"a\\nb"'
    assert systemd_quote("word\n") == '"word\\n"'
    assert systemd_quote("\x85") == '"\\u0085"'


@pytest.mark.parametrize("value", ["nul\0byte", "lone \udc80 surrogate"])
def test_values_systemd_cannot_carry_are_rejected(value: str) -> None:
    with pytest.raises(ValueError):
        systemd_quote(value)


@pytest.mark.parametrize("first", ["python3", "-/usr/bin/python3", "@/usr/bin/x", ""])
def test_exec_start_needs_an_absolute_executable(first: str) -> None:
    with pytest.raises(ValueError, match="absolute"):
        exec_start([first, "-m", "x"])


def test_exec_start_needs_a_command() -> None:
    with pytest.raises(ValueError):
        exec_start([])


# --------------------------------------------------------------------------- EnvironmentFile


def test_env_file_line_escapes_what_systemd_unescapes() -> None:
    assert env_file_line("NCCL_PROTO", "LL") == 'NCCL_PROTO="LL"'
    assert env_file_line("NCCL_BUFFSIZE", 16777216) == 'NCCL_BUFFSIZE="16777216"'
    assert env_file_line("X", 'a"b\\c$d`e f%') == 'X="a\\"b\\\\c\\$d\\`e f%"'


@pytest.mark.parametrize("key", ["1ABC", "A-B", "A B", "", "A=B", "É", "NCCL_PROTO\n"])
def test_env_file_line_rejects_bad_names(key: str) -> None:
    with pytest.raises(ValueError, match="environment variable name"):
        env_file_line(key, "x")


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\x1bb", "\x85", True, None])
def test_env_file_line_rejects_values_that_would_break_the_file(value: object) -> None:
    with pytest.raises(ValueError, match="X"):
        env_file_line("X", value)


# --------------------------------------------------------------------------- real systemd


ROOT = Path(__file__).resolve().parent.parent
IMAGE = "sglang-fleet-testhost:latest"
PROBE = (
    "import json, os, sys; print('ARGV=' + json.dumps(sys.argv[1:])); "
    "print('ENV=' + json.dumps({k: v for k, v in os.environ.items() if k.startswith('T_')}))"
)


def _ensure_image() -> None:
    """The Molecule test-host image, built on demand: `make pytest` builds it only when a test
    that needs a real systemd runs (`make image` also installs and starts Docker if missing)."""
    if shutil.which("docker"):
        image = subprocess.run(
            ["docker", "image", "inspect", IMAGE], capture_output=True, check=False, timeout=30
        )
        if image.returncode == 0:
            return
    built = subprocess.run(
        ["make", "-C", str(ROOT), "image"], capture_output=True, text=True, check=False
    )
    assert built.returncode == 0, f"make image failed:\n{built.stdout}\n{built.stderr}"


@pytest.fixture(scope="module")
def systemd_container() -> Iterator[str]:
    _ensure_image()
    name = f"flags-quote-test-{uuid.uuid4().hex[:8]}"
    # Like the Molecule test host: systemd as PID 1 with the host's cgroup tree.
    run_args = ["-d", "--rm", "--name", name, "--cgroupns", "host"]
    run_args += ["-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw"]
    run_args += ["--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp"]
    subprocess.run(
        ["docker", "run", *run_args, IMAGE, "/sbin/init"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = _exec(name, "systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.5)
        yield name
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False, timeout=60)


def _exec(
    name: str, *argv: str, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "exec", "-i", name, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        check=check,
        timeout=60,
    )


@pytest.mark.slow
@pytest.mark.container
def test_hostile_values_round_trip_through_real_systemd(systemd_container: str) -> None:
    name = systemd_container
    # The executable itself needs quoting too: a path with a space and a percent sign.
    _exec(name, "sh", "-c", "mkdir -p '/opt/ml env%' && ln -sf /usr/bin/python3 '/opt/ml env%/py'")
    argv = ["/opt/ml env%/py", "-c", PROBE, *HOSTILE]
    env = {f"T_{index}": value for index, value in enumerate(HOSTILE_ENV)}
    unit = (
        "[Service]\nType=oneshot\nEnvironmentFile=/etc/quote-probe.env\n"
        f"ExecStart={exec_start(argv)}\n"
    )
    env_file = "".join(env_file_line(key, value) + "\n" for key, value in env.items())
    _exec(name, "sh", "-c", "cat > /etc/systemd/system/quote-probe.service", stdin=unit)
    _exec(name, "sh", "-c", "cat > /etc/quote-probe.env", stdin=env_file)
    _exec(name, "systemctl", "daemon-reload")
    started = _exec(name, "systemctl", "start", "quote-probe.service", check=False)
    journal = _exec(name, "journalctl", "-u", "quote-probe.service", "-o", "cat", "--no-pager")
    assert started.returncode == 0, started.stderr + journal.stdout
    lines = journal.stdout.splitlines()
    got_argv = json.loads(next(line for line in lines if line.startswith("ARGV="))[5:])
    got_env = json.loads(next(line for line in lines if line.startswith("ENV="))[4:])
    assert got_argv == HOSTILE
    assert got_env == env
