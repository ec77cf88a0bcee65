#!/usr/bin/python
# Ansible wants DOCUMENTATION/EXAMPLES/RETURN before the imports (ansible-test checks it).
# ruff: noqa: E402
"""Ansible module sglang_flags_check: check a rendered SGLang flag list against the installed
SGLang's own parser before a running server is touched. Runs on the GPU host: standard library
only."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_flags_check
short_description: Check SGLang launch flags against the installed SGLang, without starting it
description:
  - Reads the flags of the installed SGLang from the argparse help text of
    C(python -m <launch_module> --help), with their value counts and C({a,b,c}) choices.
  - Reports every unknown flag with the closest known ones, every flag given the wrong number of
    values, and every value that is not one of the flag's choices with the allowed values.
  - Then runs SGLang's real parser on the remaining flags followed by C(--help). argparse
    converts and checks each value as it reads it and exits 2 on the first bad one, before it
    reaches C(--help); when everything parsed it prints the help and exits 0. A flag that fails
    is reported and dropped and the parser runs again, so all type errors are listed.
  - The first run is the whole list followed by C(--help). When SGLang accepts it, its output is
    the help text the checks read, so a right flag set costs one import of SGLang, not two.
  - Never starts a server and changes nothing (safe in check mode). Fails with every problem
    listed, each message naming I(variable_prefix).<flag> so the operator knows what to edit.
  - A word no command line can carry (a NUL character, text that cannot be encoded, more than
    the kernel's 128 KiB per word) is reported for its flag and left out of the runs.
version_added: "0.1.0"
author: sglang-fleet maintainers (@sglang-fleet)
options:
  python:
    description: Python interpreter of the environment SGLang is installed in.
    type: path
    required: true
  launch_module:
    description: Module run with C(python -m); Molecule points it at the GPU-less double.
    type: str
    default: sglang.launch_server
  argv:
    description:
      - The rendered flags (C(--flag value ...)), without the interpreter and module.
      - Leave out C(--config FILE), which SGLang would read while parsing.
    type: list
    elements: str
    required: true
  variable_prefix:
    description: Inventory path of the flag mapping, used in messages (C(<prefix>.<flag_key>)).
    type: str
    default: flags
  timeout:
    description: >-
      Seconds each run of the launch module may take (importing SGLang is slow); at least 1.
    type: int
    default: 300
"""

EXAMPLES = r"""
- name: Check kimi's flags against the installed SGLang
  sglang_fleet.fleet.sglang_flags_check:
    python: /opt/ml-env/bin/python
    argv: "{{ server.flag_argv }}"
    variable_prefix: "sglang_server_instances[kimi].flags"

- name: Check against the GPU-less double
  sglang_fleet.fleet.sglang_flags_check:
    python: /usr/bin/python3
    launch_module: gpusim.sglang_server
    argv: [--model-path, /models/tiny, --kv-cache-dtype, fp8_e4m3]
  environment:
    PYTHONPATH: /opt/gpusim
"""

RETURN = r"""
known_flags:
  description: Number of option strings the installed SGLang accepts (aliases counted).
  returned: when the help text could be read
  type: int
  sample: 412
sglang_version:
  description: Installed SGLang version (importlib.metadata), null when the package is absent.
  returned: always
  type: str
  sample: 0.5.23
problems:
  description: Everything wrong with the flags; empty when they all parse.
  returned: always
  type: list
  elements: dict
  contains:
    code:
      description: >-
        unknown_flag, bad_choice, value_count, stray_value, bad_value, not_argv (a word no
        command line can carry), bad_parameter (a module option out of range) or parser_error.
      type: str
    flag:
      description: The flag as written in argv (null for a problem of the whole list).
      type: str
    variable:
      description: Inventory path to edit (I(variable_prefix).<flag key>).
      type: str
    message:
      description: What is wrong, the variable, and the allowed values or closest flags.
      type: str
  sample:
    - code: bad_choice
      flag: --kv-cache-dtype
      variable: sglang_server_instances[kimi].flags.kv_cache_dtype
      message: >-
        sglang_server_instances[kimi].flags.kv_cache_dtype: 'fp8' is not a choice of
        --kv-cache-dtype; allowed: auto, fp8_e5m2, fp8_e4m3
"""

import difflib
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC: dict[str, Any] = {
    "python": {"type": "path", "required": True},
    "launch_module": {"type": "str", "default": "sglang.launch_server"},
    "argv": {"type": "list", "elements": "str", "required": True},
    "variable_prefix": {"type": "str", "default": "flags"},
    "timeout": {"type": "int", "default": 300},
}
VERSION_CODE = (
    "import importlib.metadata as m\n"
    "try:\n    print(m.version('sglang'))\n"
    "except m.PackageNotFoundError:\n    raise SystemExit(3)\n"
)
# argparse: "prog: error: argument --tp-size/--tensor-parallel-size: invalid int value: 'x'"
_ARG_ERROR_RE = re.compile(r"error: argument ([^:\s]+): (.+)$", re.MULTILINE)
_OPTION_RE = re.compile(r"--?[A-Za-z0-9][\w.-]*")  # a whole word: used with fullmatch
_CHOICES_RE = re.compile(r"^\[?\{([^{}]*)\}")
MANY = -1  # value count of nargs '+' / '*' flags
MAX_HIDDEN_PROBES = 3
# Linux MAX_ARG_STRLEN: execve() refuses a longer word (bytes, its terminating NUL included).
MAX_WORD_BYTES = 32 * 4096 - 1


@dataclass
class FlagSpec:
    """What the help text says about one option: its aliases, value count and choices."""

    options: list[str]
    min_values: int = 0
    max_values: int = 0  # MANY: no upper limit
    choices: list[str] | None = None


@dataclass
class ArgGroup:
    """One flag of argv with the words that follow it."""

    flag: str
    values: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- help text parsing


def _split_top(text: str, sep: str) -> list[str]:
    """Split on sep outside {...} and [...] (choices hold commas, metavars hold spaces)."""
    parts: list[str] = []
    depth, start, index = 0, 0, 0
    while index < len(text):
        char = text[index]
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith(sep, index):
            parts.append(text[start:index])
            index += len(sep)
            start = index
            continue
        index += 1
    return [*parts, text[start:]]


def _value_counts(words: list[str]) -> tuple[int, int]:
    """(min, max) values from an argparse args format: `X`, `X X`, `[X]`, `X [X ...]`, `[X ...]`."""
    if not words:
        return 0, 0
    if words[-1].endswith("...]"):
        return (1, MANY) if not words[0].startswith("[") else (0, MANY)
    required = sum(1 for word in words if not word.startswith("["))
    return required, len(words)


def _parse_invocation(invocation: str) -> FlagSpec | None:
    options: list[str] = []
    words: list[str] = []
    for part in _split_top(invocation, ", "):
        tokens = _split_top(part.strip(), " ")
        if not tokens or not _OPTION_RE.fullmatch(tokens[0]):
            return None
        options.append(tokens[0])
        words = words or [token for token in tokens[1:] if token]
    spec = FlagSpec(options=options)
    spec.min_values, spec.max_values = _value_counts(words)
    # Choices stand in for the metavar: `{a,b}`, `{a,b} [{a,b} ...]` or `[{a,b} ...]`.
    choices = _CHOICES_RE.match(words[0]) if words else None
    if choices:
        spec.choices = choices.group(1).split(",")
    return spec


def _invocation_lines(text: str) -> list[str]:
    """The option lines of the help (usage skipped, brace-wrapped lines joined)."""
    lines = text.splitlines()
    if lines and lines[0].lower().startswith("usage:"):
        end = next((i for i, line in enumerate(lines) if not line.strip()), len(lines))
        lines = lines[end:]
    indents = [len(line) - len(line.lstrip()) for line in lines if line.lstrip().startswith("-")]
    if not indents:
        return []
    # Help text is indented deeper than the option strings; a help line may start with "-".
    indent = min(indents)
    result: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if len(line) - len(line.lstrip()) != indent or not line.lstrip().startswith("-"):
            continue
        # Counted line by line: counting the joined text again after each line costs time
        # quadratic in the lines an unclosed "{" joins.
        parts = [line.strip()]
        depth = parts[0].count("{") - parts[0].count("}")
        while depth > 0 and index < len(lines):
            parts.append(lines[index].strip())
            depth += parts[-1].count("{") - parts[-1].count("}")
            index += 1
        result.append("".join(parts))
    return result


def parse_help(text: str) -> dict[str, FlagSpec]:
    """Option string -> FlagSpec for every option in an argparse help text."""
    known: dict[str, FlagSpec] = {}
    for line in _invocation_lines(text):
        # The help for an option follows its invocation after a gap of two or more spaces.
        invocation = _split_top(line, "  ")[0]
        spec = _parse_invocation(invocation)
        if spec is None:
            continue
        for option in spec.options:
            known[option] = spec
    known.pop("-h", None)
    known.pop("--help", None)
    return known


# --------------------------------------------------------------------------- argv checks


def group_argv(argv: list[str]) -> tuple[list[str], list[ArgGroup]]:
    """(stray words before the first flag, one group per flag)."""
    stray: list[str] = []
    groups: list[ArgGroup] = []
    for word in argv:
        if word.startswith("--") and len(word) > 2:
            groups.append(ArgGroup(flag=word))
        elif groups:
            groups[-1].values.append(word)
        else:
            stray.append(word)
    return stray, groups


def variable_of(prefix: str, flag: str) -> str:
    return f"{prefix}.{flag.lstrip('-').replace('-', '_')}"


def _problem(code: str, flag: str | None, variable: str, message: str) -> dict[str, Any]:
    return {"code": code, "flag": flag, "variable": variable, "message": f"{variable}: {message}"}


def _unknown(group: ArgGroup, known: dict[str, FlagSpec], prefix: str) -> dict[str, Any]:
    flag = group.flag
    swapped = "--" + (flag[2:].replace("-", "_") if "-" in flag[2:] else flag[2:].replace("_", "-"))
    if swapped in known:
        hint = f"this SGLang spells it {swapped}"
    else:
        close = difflib.get_close_matches(flag, list(known), n=3, cutoff=0.6)
        hint = f"closest: {', '.join(close)}" if close else "no similar flag"
    return _problem(
        "unknown_flag",
        flag,
        variable_of(prefix, flag),
        f"{flag} is not a flag of the installed SGLang ({hint})",
    )


def _count_problem(group: ArgGroup, spec: FlagSpec, prefix: str) -> dict[str, Any] | None:
    count = len(group.values)
    if spec.min_values <= count and (spec.max_values == MANY or count <= spec.max_values):
        return None
    if spec.max_values == 0:
        expected = "no value (a switch: set the key to true or false)"
    elif spec.max_values == MANY:
        expected = f"at least {spec.min_values} value(s)"
    elif spec.min_values == spec.max_values:
        expected = f"exactly {spec.min_values} value(s)"
    else:
        expected = f"{spec.min_values} to {spec.max_values} values"
    return _problem(
        "value_count",
        group.flag,
        variable_of(prefix, group.flag),
        f"{group.flag} takes {expected}; got {group.values}",
    )


def _choice_problem(group: ArgGroup, spec: FlagSpec, prefix: str) -> dict[str, Any] | None:
    if spec.choices is None:
        return None
    bad = [value for value in group.values if value not in spec.choices]
    if not bad:
        return None
    return _problem(
        "bad_choice",
        group.flag,
        variable_of(prefix, group.flag),
        f"{', '.join(repr(v) for v in bad)} is not a choice of {group.flag}; allowed: "
        f"{', '.join(spec.choices)}",
    )


def _word_problem(word: str) -> str | None:
    """Why a word cannot be one argument of a command line, or None."""
    if "\0" in word:
        return "holds a NUL character, which no command line can carry"
    try:
        size = len(os.fsencode(word))
    except UnicodeEncodeError:
        return "holds text that cannot be encoded for a command line"
    if size > MAX_WORD_BYTES:
        return f"is {size} bytes long; one command-line word may hold at most {MAX_WORD_BYTES}"
    return None


def unpassable_words(argv: list[str], prefix: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(one not_argv problem per flag holding a word no command line carries, argv without them)."""
    stray, groups = group_argv(argv)
    problems: list[dict[str, Any]] = []
    stray_reason = next(filter(None, map(_word_problem, stray)), None)
    if stray_reason:
        problems.append(
            _problem("not_argv", None, prefix, f"a value before any flag {stray_reason}")
        )
        stray = [word for word in stray if not _word_problem(word)]
    kept: list[ArgGroup] = []
    for group in groups:
        flag_problem = _word_problem(group.flag)
        reason = flag_problem or next(filter(None, map(_word_problem, group.values)), None)
        if reason is None:
            kept.append(group)
            continue
        # A flag that cannot be passed cannot name a variable either: report the mapping.
        variable = prefix if flag_problem else variable_of(prefix, group.flag)
        what = "a flag name" if flag_problem else f"a value of {group.flag}"
        problems.append(
            _problem("not_argv", None if flag_problem else group.flag, variable, f"{what} {reason}")
        )
    return problems, stray + _flatten(kept)


def static_problems(
    argv: list[str], known: dict[str, FlagSpec], prefix: str
) -> tuple[list[dict[str, Any]], list[ArgGroup], list[ArgGroup]]:
    """(problems the help text shows, groups left for SGLang's parser, flags not in the help)."""
    stray, groups = group_argv(argv)
    problems: list[dict[str, Any]] = []
    if stray:
        problems.append(
            _problem("stray_value", None, prefix, f"values {stray} come before any flag")
        )
    passed: list[ArgGroup] = []
    unlisted: list[ArgGroup] = []
    for group in groups:
        spec = known.get(group.flag)
        if spec is None:
            unlisted.append(group)
            continue
        problem = _count_problem(group, spec, prefix) or _choice_problem(group, spec, prefix)
        if problem:
            problems.append(problem)
        else:
            passed.append(group)
    return problems, passed, unlisted


def parser_error(stderr: str) -> tuple[list[str], str] | None:
    """(option strings, message) of argparse's last "error: argument X: msg" line."""
    matches = list(_ARG_ERROR_RE.finditer(stderr))
    if not matches:
        return None
    names, message = matches[-1].group(1), matches[-1].group(2).strip()
    return names.split("/"), message


# --------------------------------------------------------------------------- running SGLang


def run(argv: list[str], timeout: int) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); 126/127/124 when the command could not run or finish."""
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    except (OSError, ValueError) as exc:  # E2BIG, EACCES, a NUL in the interpreter's path
        return 126, "", f"cannot run {argv[0]!r}: {exc}"
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout} s: {' '.join(argv[:3])}"
    return proc.returncode, proc.stdout, proc.stderr


def _short(text: str, limit: int = 80) -> str:
    """A value as a message shows it: a 5000-digit number need not be repeated in full."""
    return text if len(text) <= limit else f"{text[: limit - 20]}... ({len(text)} characters)"


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def sglang_version(python: str, timeout: int) -> str | None:
    rc, out, _err = run([python, "-c", VERSION_CODE], timeout)
    if rc != 0 or not out.strip():
        return None
    return out.strip()


def read_flags(python: str, launch_module: str, timeout: int) -> dict[str, FlagSpec]:
    rc, out, err = run([python, "-m", launch_module, "--help"], timeout)
    if rc != 0:
        raise RuntimeError(
            f"cannot read the flags: `{python} -m {launch_module} --help` exited {rc}: "
            f"{_tail(err or out)}"
        )
    known = parse_help(out)
    if not known:
        raise RuntimeError(f"`{python} -m {launch_module} --help` printed no flags")
    return known


def _flatten(groups: list[ArgGroup]) -> list[str]:
    return [word for group in groups for word in (group.flag, *group.values)]


def parser_problems(
    python: str, launch_module: str, groups: list[ArgGroup], prefix: str, timeout: int
) -> list[dict[str, Any]]:
    """Run SGLang's parser until it accepts what is left; one problem per rejected flag."""
    problems: list[dict[str, Any]] = []
    remaining = list(groups)
    # Each failing run removes one flag, so this ends after at most len(groups) + 1 runs.
    for _round in range(len(groups) + 1):
        rc, out, err = run([python, "-m", launch_module, *_flatten(remaining), "--help"], timeout)
        if rc == 0:
            return problems
        found = parser_error(err) if rc == 2 else None
        names = found[0] if found else []
        culprit = next((group for group in remaining if group.flag in names), None)
        if found is None or culprit is None:
            problems.append(
                _problem(
                    "parser_error",
                    None,
                    prefix,
                    f"SGLang's parser rejected the flags (exit {rc}): {_tail(err or out)}",
                )
            )
            return problems
        problems.append(
            _problem(
                "bad_value",
                culprit.flag,
                variable_of(prefix, culprit.flag),
                f"SGLang rejects {culprit.flag} {' '.join(map(_short, culprit.values))}: "
                f"{_short(found[1], 200)}",
            )
        )
        remaining.remove(culprit)
    return problems


def is_hidden_flag(python: str, launch_module: str, group: ArgGroup, timeout: int) -> bool:
    """Whether a flag missing from --help exists anyway (argparse.SUPPRESS hides some).

    `<flag> --help` makes argparse complain that a value-taking flag got no value, while an
    unknown flag is set aside and --help exits 0. A hidden switch cannot be told apart.
    """
    if not group.values:
        return False
    rc, _out, err = run([python, "-m", launch_module, group.flag, "--help"], timeout)
    found = parser_error(err) if rc == 2 else None
    return bool(found and group.flag in found[0])


def check(params: dict[str, Any]) -> dict[str, Any]:
    """The module's work, without AnsibleModule (tested directly)."""
    python, module, timeout = params["python"], params["launch_module"], params["timeout"]
    prefix = params["variable_prefix"]
    result: dict[str, Any] = {
        "changed": False,
        "sglang_version": None,
        "known_flags": None,
        "problems": [],
    }
    if timeout < 1:
        result["problems"] = [
            _problem("bad_parameter", None, "timeout", f"must be at least 1 second, got {timeout}")
        ]
        return result
    result["sglang_version"] = sglang_version(python, timeout)
    problems, argv = unpassable_words(list(params["argv"]), prefix)
    # One import of SGLang when the flags are right: its parser reads the whole list and, with
    # nothing to complain about, reaches --help and prints the help text the checks below need.
    rc, out, _err = run([python, "-m", module, *argv, "--help"], timeout)
    known = parse_help(out) if rc == 0 else {}
    if not known:
        try:
            known = read_flags(python, module, timeout)
        except RuntimeError as exc:
            result["problems"] = [_problem("parser_error", None, prefix, str(exc))]
            return result
    result["known_flags"] = len(known)
    static, passed, unlisted = static_problems(argv, known, prefix)
    problems += static
    if rc == 0 and not static and not unlisted:
        # SGLang's parser already took every flag (argparse set none aside): nothing to rerun.
        result["problems"] = problems
        return result
    for index, group in enumerate(unlisted):
        # Each probe imports SGLang again (seconds): only a few, then unknown is unknown.
        if index < MAX_HIDDEN_PROBES and is_hidden_flag(python, module, group, timeout):
            passed.append(group)
        else:
            problems.append(_unknown(group, known, prefix))
    problems += parser_problems(python, module, passed, prefix, timeout)
    result["problems"] = problems
    return result


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    result = check(module.params)
    if result["problems"]:
        version = result["sglang_version"] or "unknown version"
        lines = [problem["message"] for problem in result["problems"]]
        module.fail_json(
            msg=f"{len(lines)} problem(s) with the SGLang flags (SGLang {version}):\n"
            + "\n".join(lines),
            **result,
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
