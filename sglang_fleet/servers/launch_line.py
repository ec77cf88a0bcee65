"""Render SGLang flags for a systemd unit: argv, the ExecStart= line and EnvironmentFile= lines.

A server's flags are a mapping in the inventory, keyed like SGLang's ServerArgs fields::

    {"model_path": "/models/kimi", "tp_size": 8, "mem_fraction_static": 0.88,
     "enable_hierarchical_cache": True, "hicache_size": 48, "disable_radix_cache": False}

    to_argv(...) == ["--model-path", "/models/kimi", "--enable-hierarchical-cache",
                     "--hicache-size", "48", "--mem-fraction-static", "0.88", "--tp-size", "8"]

The order is fixed (model path first, then by key) so rendering the same mapping twice gives the
same unit file and a rerun shows no diff.

Quoting rules, from the systemd manual pages (systemd 252, Debian 12; the same rules hold from
systemd 249 on Ubuntu 22.04):

- systemd.service(5), "COMMAND LINES": an ExecStart= line is split into words like a shell would
  (whitespace separates words, single or double quotes group them); a lone unquoted ``;``
  separates two command lines; the first word may carry the prefixes ``@ - : + !`` (they are
  read after unquoting, so quoting does not protect them: the first word must be an absolute
  path); ``$FOO``/``${FOO}`` are expanded at start-up and ``$$`` is a literal dollar;
  ``%`` specifiers are expanded and ``%%`` is a literal percent sign (expansion runs after
  the C unescaping, so ``\\x25`` would still be expanded: only ``%%`` is safe).
- systemd.syntax(7), "QUOTING": inside double quotes C escapes are decoded (``\\\\ \\" \\n \\t
  \\r \\xNN \\uNNNN``), a line ending in a backslash continues on the next line, and the unit
  file must be valid UTF-8 (``\\xNN`` >= 0x80 would produce a raw byte, so C1 controls use
  ``\\uNNNN``). NUL cannot be passed at all.
- systemd.exec(5), "EnvironmentFile=": ``KEY="value"``; inside double quotes a backslash escapes
  ``" \\ ` $`` (systemd's SHELL_NEED_ESCAPE) and any other backslash is kept literally; no
  specifier or variable expansion. Control characters other than TAB are rejected here:
  systemd before 240 drops such assignments, and a raw newline would split the line.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

# Whole-string patterns, used with fullmatch: `$` alone would also accept a trailing newline.
_KEY_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Characters that mean nothing to systemd's ExecStart= parser: a word made only of these is
# written bare, which keeps the common case (paths, numbers, dtype names) easy to read.
_BARE_WORD_RE = re.compile(r"[A-Za-z0-9_+=:,./@-]+")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_ENV_ESCAPED = set('"\\`$')
_FIRST = "model_path"
_EXACT_INT_FLOAT = 2.0**53  # beyond this not every integer is a float


def flag_name(key: str) -> str:
    """`mem_fraction_static` (or `mem-fraction-static`) -> `--mem-fraction-static`."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"flag key {key!r} is not a SGLang flag name: use lower-case letters, digits, "
            "'_' or '-' (like mem_fraction_static)"
        )
    return "--" + key.replace("_", "-")


def normalize_key(key: str) -> str:
    """The ServerArgs spelling of a flag key: dashes become underscores."""
    flag_name(key)  # validates
    return key.replace("-", "_")


def render_scalar(value: Any) -> str:
    """One argv word for a value: numbers without float noise, mappings as compact JSON."""
    if isinstance(value, bool):
        # Only reachable inside lists and JSON: a top-level boolean is a switch, not a word.
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # An integral float is written as an integer: SGLang's int flags reject "48.0" while
        # its float flags accept "48". repr() is the shortest round-tripping form (0.88, 1e+20).
        if math.isfinite(value) and value.is_integer() and abs(value) < _EXACT_INT_FLOAT:
            return str(int(value))
        return repr(value)
    if isinstance(value, Mapping):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, str):
        return value
    raise ValueError(f"cannot render {type(value).__name__} value {value!r} as a flag value")


def _ordered_keys(flags: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(normalized key, original key) pairs: model_path first, then sorted."""
    seen: dict[str, str] = {}
    for key in flags:
        norm = normalize_key(key)
        if norm in seen:
            raise ValueError(f"flag key {key!r} repeats {seen[norm]!r} (same flag)")
        seen[norm] = key
    return sorted(seen.items(), key=lambda item: (item[0] != _FIRST, item[0]))


def to_argv(flags: Mapping[str, Any]) -> list[str]:
    """SGLang flag mapping -> argv words, in a stable order.

    True -> bare switch; False/None -> omitted; list -> `--flag a b c` (an empty list is
    omitted, like None: SGLang's list flags need at least one value); mapping -> compact JSON.
    """
    argv: list[str] = []
    for norm, key in _ordered_keys(flags):
        value = flags[key]
        name = flag_name(norm)
        if value is None or value is False:
            continue
        if value is True:
            argv.append(name)
        elif isinstance(value, list | tuple):
            if value:
                argv += [name, *(render_scalar(item) for item in value)]
        else:
            argv += [name, render_scalar(value)]
    return argv


def _escape_char(char: str) -> str:
    if char in _C_ESCAPES:
        return _C_ESCAPES[char]
    if char == "\0":
        raise ValueError("a NUL character cannot be passed in a systemd command line")
    if unicodedata.category(char) == "Cc":
        code = ord(char)
        return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}"
    return char


def _check_utf8(arg: str) -> None:
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"value {arg!r} is not valid UTF-8 text: {exc.reason}") from None


def systemd_quote(arg: str) -> str:
    """One argv word as systemd's ExecStart= parser reads it back unchanged.

    `%` -> `%%` (specifier), `$` -> `$$` (variable), and anything but plain characters is put in
    double quotes with C escapes, so `;`, spaces, quotes, backslashes and newlines stay inside the
    one word.
    """
    if not isinstance(arg, str):
        raise ValueError(f"argv word {arg!r} is not a string")
    _check_utf8(arg)
    if _BARE_WORD_RE.fullmatch(arg):
        return arg
    body = "".join(_escape_char(char) for char in arg)
    return '"' + body.replace("%", "%%").replace("$", "$$") + '"'


def exec_start(argv: Iterable[str]) -> str:
    """The value of an `ExecStart=` line for argv (argv[0] an absolute path)."""
    words = list(argv)
    if not words:
        raise ValueError("ExecStart= needs at least the executable")
    # systemd reads the prefixes @-:+! from the first word after unquoting, so no quoting could
    # protect a first word starting with one of them: insist on an absolute path.
    if not isinstance(words[0], str) or not words[0].startswith("/"):
        raise ValueError(f"executable {words[0]!r} must be an absolute path")
    return " ".join(systemd_quote(word) for word in words)


def env_file_line(key: str, value: Any) -> str:
    """`KEY="value"` for a systemd EnvironmentFile=, read back by systemd unchanged."""
    if not isinstance(key, str) or not _ENV_KEY_RE.fullmatch(key):
        raise ValueError(
            f"environment variable name {key!r} is invalid: use letters, digits and '_', "
            "not starting with a digit"
        )
    if isinstance(value, bool) or value is None:
        raise ValueError(
            f"environment variable {key}: value {value!r} is ambiguous; quote it in YAML "
            "(for example '1', 'true' or '')"
        )
    text = render_scalar(value)
    _check_utf8(text)
    for char in text:
        if char != "\t" and unicodedata.category(char) == "Cc":
            raise ValueError(
                f"environment variable {key}: control character {char!r} is not allowed in "
                "an EnvironmentFile value"
            )
    body = "".join("\\" + char if char in _ENV_ESCAPED else char for char in text)
    return f'{key}="{body}"'
