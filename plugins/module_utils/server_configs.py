"""The sglang@ servers' launch configuration as written on a GPU host, and the one reader of its
`ExecStart=` lines. Standard library only; every listing and every file is bounded, and what
cannot be read or understood is said, never taken for "nothing there".

Where: the drop-ins of each sglang@NAME unit (<systemd_dir>/sglang@NAME.service.d/*.conf, and
sglang@.service.d for every instance) and the copies each server keeps as last-known-good
(<state_dir>/NAME/lkg/*.conf), walked once by `launch_commands`.

What: `exec_starts(text, unit)` reads a unit file or drop-in as systemd does
(systemd.syntax(7), systemd.service(5) "COMMAND LINES"): comment lines (`#`, `;`) even inside a
continuation; a line ending in an odd number of backslashes continued on the next; sections
(only [Service], or no section, holds ExecStart=); an empty `ExecStart=` resets the list; words
split and unquoted like systemd's extract_first_word (quotes anywhere in a word, C escapes inside
and outside quotes, an unknown escape kept as written); a lone `;` between commands and `\\;` for
a literal one; the prefixes `@ - : + ! !!` in any order systemd takes; `%%` and the specifiers
that follow from the unit's name (%n %N %p %i %d); `$$` for a dollar. `launched(command)` is the
program an `env` wrapper runs (`env [-i] [-u NAME] [-C DIR] [-S STRING] [NAME=VALUE...] PROG`).

What it does not resolve makes the file NotUnderstood, with the reason: another specifier (its
value is systemd's: the host name, a user's home), an environment variable (`$FOO`, `${FOO}`),
the `|` prefix (a shell), unbalanced quoting, a relative program, `env` finding its program on a
PATH this reader does not see. Readers (model pruning in model_in_use, the SGLang versions in
plugins/modules/ml_env_versions.py) refuse to remove anything then. launch_line.py writes only what
this reader understands (tests/test_fail_closed_users.py round-trips its hostile values).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import read_regular

MAX_ENTRIES = 4096  # servers in a state folder, unit folders, files in one of them
MAX_CONF_BYTES = 1 << 20  # a drop-in is a few hundred bytes; systemd's own line limit is 1 MiB
LKG_DIR = "lkg"
MAX_ENV_WRAPS = 8  # env running env running ...: more is no launch line of ours

WHITESPACE = " \t\n\r"  # systemd's separators (extract-word)
COMMENTS = "#;"
# systemd looks a bare program name up in these (systemd.service(5), "COMMAND LINES").
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
_LINE_END = re.compile(r"\r\n|\r|\n")
_TEMPLATE_INSTANCE = re.compile(r"([^@/]+)@([^@/]+)\.service")
_SIMPLE_ESCAPES = {
    "a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11,
    "\\": 92, '"': 34, "'": 39, "s": 32,
}  # fmt: skip
_HEX = frozenset("0123456789abcdefABCDEF")
_OCT = frozenset("01234567")
_ENV_SPLIT_WHITESPACE = " \t\n\v\f\r"
_ENV_SPLIT_ESCAPES = {'"': '"', "#": "#", "$": "$", "'": "'", "\\": "\\",
                      "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}  # fmt: skip


class NotUnderstood(ValueError):
    """A launch line this reader cannot read as systemd would run it; the message says why."""


@dataclass(frozen=True)
class Command:
    """One command of an ExecStart= line as systemd runs it.

    path: the file executed, as written (absolute, or a bare name systemd looks up in
    SEARCH_PATH); argv: what the program gets, argv[0] included (the word after the path when
    the `@` prefix is given); prefixes: the special prefixes of the first word."""

    path: str
    argv: tuple[str, ...]
    prefixes: str = ""

    @property
    def words(self) -> tuple[str, ...]:
        """Every word of the command, the executable first: what may name a path."""
        return (self.path, *self.argv)


@dataclass(frozen=True)
class LaunchFile:
    """A file that holds a launch line: who it is for (shown), its path, and the unit it
    configures ("" when it is every instance's: sglang@.service.d)."""

    who: str
    path: str
    unit: str


# --------------------------------------------------------------------------- where they are


def listing(folder: str, what: str) -> tuple[list[str], str]:
    """(the names in folder, sorted; why not all of them could be read, "" when they could).
    A folder that does not exist holds nothing; one that cannot be listed, or holds more than
    MAX_ENTRIES names (no more are read), is a problem named with `what`."""
    names: list[str] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if len(names) == MAX_ENTRIES:
                    return sorted(names), (
                        f"{what} {folder} holds more than the {MAX_ENTRIES} entries read"
                    )
                names.append(entry.name)
    except FileNotFoundError:
        return [], ""
    except OSError as err:
        return [], f"{what} {folder} cannot be listed ({err.strerror or err})"
    return sorted(names), ""


def _confs(folder: str, what: str) -> tuple[list[str], str]:
    if not os.path.isdir(folder):
        # A file or a dangling link where a folder of drop-ins belongs: systemd reads nothing
        # there, but neither can this reader prove what was meant.
        return [], f"{what} {folder} is not a folder" if os.path.lexists(folder) else ""
    names, problem = listing(folder, what)
    return [os.path.join(folder, n) for n in names if n.endswith(".conf")], problem


def launch_files(systemd_dir: str, state_dir: str) -> tuple[list[LaunchFile], list[str]]:
    """Every drop-in of an sglang@ unit, then every last-known-good copy; and the problems: each
    folder that could not be listed completely."""
    files: list[LaunchFile] = []
    problems: list[str] = []
    entries, problem = listing(systemd_dir, "the units' folder")
    problems += [problem] if problem else []
    for entry in entries:
        if entry.startswith("sglang@") and entry.endswith(".service.d"):
            unit = entry[: -len(".d")]
            paths, problem = _confs(os.path.join(systemd_dir, entry), "the drop-in folder")
            problems += [problem] if problem else []
            instance = unit if not unit.startswith("sglang@.") else ""
            files += [LaunchFile(f"{unit} (its unit)", path, instance) for path in paths]
    servers, problem = listing(state_dir, "the servers' state folder")
    problems += [problem] if problem else []
    for server in servers:
        lkg = os.path.join(state_dir, server, LKG_DIR)
        if not os.path.lexists(lkg):
            continue
        paths, problem = _confs(lkg, "the last-known-good folder")
        problems += [problem] if problem else []
        unit = f"sglang@{server}.service"
        files += [LaunchFile(f"{server} (its last-known-good)", path, unit) for path in paths]
    return files, problems


def read_conf(path: str) -> str | None:
    """A drop-in's text; None when it is gone. NotUnderstood when it is not a regular file (a
    link, a FIFO), cannot be read, is over MAX_CONF_BYTES, is not UTF-8 or holds a NUL."""
    try:
        data = read_regular(path, MAX_CONF_BYTES)
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or err
        raise NotUnderstood(f"{path} cannot be read ({reason})") from None
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise NotUnderstood(f"{path} is not UTF-8 text (systemd ignores such lines)") from None
    if "\0" in text:
        raise NotUnderstood(f"{path} holds a NUL byte")
    return text


def launch_commands(
    systemd_dir: str, state_dir: str
) -> tuple[list[tuple[LaunchFile, list[Command]]], list[str]]:
    """Each launch file with the commands of its effective ExecStart= lines; and every problem:
    a folder not listed completely, a file not read, a line not understood (each names it)."""
    files, problems = launch_files(systemd_dir, state_dir)
    found: list[tuple[LaunchFile, list[Command]]] = []
    for launch in files:
        try:
            text = read_conf(launch.path)
            if text is not None:
                found.append((launch, exec_starts(text, launch.unit)))
        except NotUnderstood as err:
            message = str(err)
            problems.append(message if message.startswith(launch.path) else f"{launch.path}: {err}")
    return found, problems


# --------------------------------------------------------------------------- the unit file


def _logical_lines(text: str) -> list[str]:
    """The lines systemd's config parser hands on: comment lines dropped (inside a
    continuation too), a line ending in an odd number of backslashes joined to the next with
    that backslash made a space."""
    lines: list[str] = []
    pending: str | None = None
    for raw in _LINE_END.split(text.removeprefix("\ufeff")):
        stripped = raw.lstrip(WHITESPACE)
        if stripped and stripped[0] in COMMENTS:
            continue
        joined = raw if pending is None else pending + raw
        trailing = len(joined) - len(joined.rstrip("\\"))
        if trailing % 2:
            pending = joined[:-1] + " "
            continue
        lines.append(joined)
        pending = None
    if pending is not None:
        lines.append(pending)
    return lines


def _exec_start_values(text: str) -> list[str]:
    """The value of each ExecStart= assignment in [Service] (or before any section, as a bare
    copy holds it), in order; systemd ignores the key in other sections."""
    values: list[str] = []
    section: str | None = None
    for logical in _logical_lines(text):
        line = logical.strip(WHITESPACE)
        if not line or line[0] in COMMENTS:
            continue
        if line.startswith("["):
            if not line.endswith("]") or len(line) < 3:
                raise NotUnderstood(f"{shown(line)} is no section header")
            section = line[1:-1]
            continue
        if line.startswith(".include"):
            raise NotUnderstood(".include: another file's lines, which this reader does not read")
        key, equals, value = line.partition("=")
        if equals and key.strip(WHITESPACE) == "ExecStart" and section in (None, "Service"):
            values.append(value.strip(WHITESPACE))
    return values


def exec_starts(text: str, unit: str = "") -> list[Command]:
    """The commands of the effective ExecStart= lines of a unit file or drop-in (what is left
    after the last empty `ExecStart=`), each as systemd would run it; unit: the unit's name,
    for the specifiers that follow from it ("" when unknown). NotUnderstood says why not."""
    commands: list[Command] = []
    for value in _exec_start_values(text):
        if not value:
            commands = []
        else:
            commands += exec_start(value, unit)
    return commands


def shown(text: str, limit: int = 60) -> str:
    """A word or line as an error message shows it: repr, cut."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


# --------------------------------------------------------------------------- one value


def exec_start(value: str, unit: str = "") -> list[Command]:
    """The commands of one ExecStart= value (systemd's config_parse_exec)."""
    commands: list[Command] = []
    pos, end = 0, len(value)
    while True:
        first, pos = _extract(value, pos)
        if first is None:
            return commands
        if first == ";":
            continue
        prefixes, path = _prefixes(first)
        path = _specifiers(path, unit)
        _check_path(path, first)
        argv: list[str] = [] if "@" in prefixes else [path]
        more = False
        while pos < end:
            if value[pos] == ";" and (pos + 1 == end or value[pos + 1] in WHITESPACE):
                pos, more = _skip(value, pos + 1), True
                break
            if value.startswith("\\;", pos) and (pos + 2 == end or value[pos + 2] in WHITESPACE):
                argv.append(";")
                pos = _skip(value, pos + 2)
                continue
            word, pos = _extract(value, pos)
            if word is None:
                break
            argv.append(_specifiers(word, unit))
        if not argv:
            raise NotUnderstood(f"{shown(first)}: the @ prefix needs the word argv[0] after it")
        if ":" not in prefixes:
            argv = [_dollars(word) for word in argv]
        commands.append(Command(path, tuple(argv), prefixes))
        if not more:
            return commands


def _skip(value: str, pos: int) -> int:
    while pos < len(value) and value[pos] in WHITESPACE:
        pos += 1
    return pos


def _extract(value: str, pos: int) -> tuple[str | None, int]:
    """systemd's extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE), with its retry that
    keeps an unknown escape as written: the next word (None at the end) and where the next one
    starts."""
    pos = _skip(value, pos)
    end = len(value)
    if pos >= end:
        return None, end
    out = bytearray()
    quote = ""
    while pos < end:
        char = value[pos]
        if char == "\\":
            if pos + 1 >= end:
                if quote:
                    break  # unbalanced, refused below
                out += b"\\"  # a trailing backslash is kept
                pos += 1
                break
            used, piece = _unescape(value, pos + 1)
            out += piece
            pos += 1 + used
        elif quote:
            if char == quote:
                quote = ""
            else:
                out += char.encode()
            pos += 1
        elif char in "'\"":
            quote = char
            pos += 1
        elif char in WHITESPACE:
            pos = _skip(value, pos)
            break
        else:
            out += char.encode()
            pos += 1
    if quote:
        raise NotUnderstood(f"unbalanced quoting in {shown(value)}: systemd ignores the line")
    return out.decode("utf-8", errors="surrogateescape"), pos


def _hex_at(value: str, start: int, count: int) -> int | None:
    digits = value[start : start + count]
    if len(digits) != count or not set(digits) <= _HEX:
        return None
    return int(digits, 16)


def _unescape(value: str, pos: int) -> tuple[int, bytes]:
    """systemd's cunescape_one at value[pos] (after a backslash): (characters used, bytes)."""
    char = value[pos]
    if char in _SIMPLE_ESCAPES:
        return 1, bytes([_SIMPLE_ESCAPES[char]])
    if char == "x":
        code = _hex_at(value, pos + 1, 2)
        if code:  # \x00 is refused by systemd, and kept as written
            return 3, bytes([code])
    elif char in "uU":
        width = 4 if char == "u" else 8
        code = _hex_at(value, pos + 1, width)
        if code:
            if (
                code >= 0x110000
                or 0xD800 <= code <= 0xDFFF
                or 0xFDD0 <= code <= 0xFDEF
                or (code & 0xFFFE == 0xFFFE)
            ):
                # systemd's versions differ on these; no launch line of ours holds one.
                raise NotUnderstood(f"the escape \\{char}{code:0{width}x} is no character here")
            return 1 + width, chr(code).encode()
    elif char in _OCT:
        digits = value[pos : pos + 3]
        if len(digits) == 3 and set(digits) <= _OCT and 0 < int(digits, 8) <= 255:
            return 3, bytes([int(digits, 8)])
    return 1, b"\\" + char.encode()


def _prefixes(first: str) -> tuple[str, str]:
    """(the special prefixes, the path): each of `-`, `@`, `:` once, and one of `+`, `!`, `!!`,
    in any order (systemd's config_parse_exec)."""
    seen = ""
    for index, char in enumerate(first):
        once = char in "-@:" and char not in seen
        privileged = char == "+" and not set(seen) & {"+", "!"}
        unprivileged = char == "!" and "+" not in seen and seen.count("!") < 2
        if once or privileged or unprivileged:
            seen += char
        elif char == "|":
            raise NotUnderstood(f"{shown(first)}: the | prefix runs the line through a shell")
        else:
            return seen, first[index:]
    return seen, ""


def _check_path(path: str, first: str) -> None:
    if not path:
        raise NotUnderstood(f"{shown(first)} names no program after its prefixes")
    if any(ord(c) < 32 or c in "\"'\\\x7f" for c in path):
        raise NotUnderstood(f"{shown(first)}: systemd refuses such a program path")
    if "$" in path:
        raise NotUnderstood(f"{shown(first)}: a $ in the program path")
    if path in (".", "..") or path.endswith("/") or ("/" in path and not path.startswith("/")):
        raise NotUnderstood(f"{shown(first)} is neither an absolute path nor a program name")


def _unit_values(unit: str) -> dict[str, str]:
    """The specifiers that follow from an instance's name (systemd.unit(5), "SPECIFIERS")."""
    match = _TEMPLATE_INSTANCE.fullmatch(unit)
    if not match:
        return {}
    return {"n": unit, "N": unit[: -len(".service")], "p": match[1], "i": match[2],
            "d": f"/run/credentials/{unit}"}  # fmt: skip


def _specifiers(word: str, unit: str) -> str:
    """word with its % specifiers resolved; NotUnderstood for one that is systemd's to know."""
    if "%" not in word:
        return word
    values = _unit_values(unit)
    out: list[str] = []
    index = 0
    while index < len(word):
        char = word[index]
        if char != "%":
            out.append(char)
            index += 1
            continue
        spec = word[index + 1 : index + 2]
        if spec == "%":
            out.append("%")
        elif spec in values:
            out.append(values[spec])
        else:
            raise NotUnderstood(
                f"the specifier %{spec} in {shown(word)}: its value is systemd's "
                f"({'an instance of ' + unit if unit else 'every instance'}), not known here"
            )
        index += 2
    return "".join(out)


def _dollars(word: str) -> str:
    """`$$` is a dollar; any other `$` is an environment variable systemd expands at start."""
    if "$" not in word:
        return word
    parts = word.split("$$")
    if any("$" in part for part in parts):
        raise NotUnderstood(
            f"{shown(word)} depends on an environment variable, set where this reader does not look"
        )
    return "$".join(parts)


# --------------------------------------------------------------------------- env wrappers


def launched(command: Command) -> Command:
    """The program a command runs in the end: through `env` (any path whose name is env) the
    program env runs, with its argv; otherwise the command itself. NotUnderstood when env's
    arguments are not understood or its program is not a path (env looks it up on the PATH of
    the service, which this reader does not see)."""
    for _wrap in range(MAX_ENV_WRAPS):
        if os.path.basename(command.path) != "env":
            return command
        command = _after_env(command)
    raise NotUnderstood(f"env runs env more than {MAX_ENV_WRAPS} times")


_ENV_FLAGS = {"i", "0", "v"}
_ENV_WITH_VALUE = {"u", "C", "S", "a"}
_ENV_LONG_FLAGS = {"ignore-environment", "null", "debug"}
_ENV_LONG_VALUE = {"unset": "u", "chdir": "C", "split-string": "S", "argv0": "a"}
_ENV_LONG_OPTIONAL = {"block-signal", "default-signal", "ignore-signal"}


def _after_env(command: Command) -> Command:
    """GNU env's own arguments read (options stop at the first word that is none; `-S`'s words
    are read as arguments in its place), then its assignments; the first word left is the
    program."""
    args = list(command.argv[1:])
    chdir = ""
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            index += 1
            break
        if arg == "-":  # the same as -i
            index += 1
            continue
        if not arg.startswith("-"):
            break
        option, value, used = _env_option(arg, args[index + 1 : index + 2])
        index += used
        if option == "S":
            args[index:index] = _split_string(value)
        elif option == "C":
            chdir = value
    while index < len(args) and "=" in args[index]:
        index += 1
    if index >= len(args):
        return command  # env alone prints its environment: it runs nothing else
    program = args[index]
    if "/" not in program:
        raise NotUnderstood(
            f"env runs {shown(program)} from the service's PATH, which this reader does not see"
        )
    if not program.startswith("/"):
        if not chdir.startswith("/"):
            raise NotUnderstood(f"env runs {shown(program)}, relative to a folder not known here")
        program = os.path.join(chdir, program)
    return Command(program, tuple(args[index:]), "")


def _env_option(arg: str, following: list[str]) -> tuple[str, str, int]:
    """One of env's option words: (the option's letter, its value, words used)."""
    return _env_long(arg, following) if arg.startswith("--") else _env_short(arg, following)


def _env_long(arg: str, following: list[str]) -> tuple[str, str, int]:
    name, equals, value = arg[2:].partition("=")
    if name in _ENV_LONG_FLAGS and not equals:
        return name, "", 1
    if name in _ENV_LONG_OPTIONAL:
        return name, value, 1
    if name in _ENV_LONG_VALUE and (equals or following):
        return (
            (_ENV_LONG_VALUE[name], value, 1)
            if equals
            else (_ENV_LONG_VALUE[name], following[0], 2)
        )
    raise NotUnderstood(f"env's option {shown(arg)} is not one this reader knows")


def _env_short(arg: str, following: list[str]) -> tuple[str, str, int]:
    for position, letter in enumerate(arg[1:], 1):
        if letter in _ENV_FLAGS:
            continue
        if letter not in _ENV_WITH_VALUE:
            raise NotUnderstood(f"env's option {shown(arg)} is not one this reader knows")
        rest = arg[position + 1 :]
        if rest:
            return letter, rest, 1
        if following:
            return letter, following[0], 2
        raise NotUnderstood(f"env's option -{letter} without its value")
    return "", "", 1


def _split_escape(text: str, escaped: str, quote: str) -> str | None:
    """What env -S makes of a backslash and `escaped`: the character, or None where it ends a
    word (`\\_` outside quotes)."""
    if escaped == "_":
        return " " if quote else None
    if escaped in _ENV_SPLIT_ESCAPES:
        return _ENV_SPLIT_ESCAPES[escaped]
    raise NotUnderstood(f"env -S {shown(text)}: the escape \\{escaped} is env's error")


def _split_string(text: str) -> list[str]:
    """GNU env's -S: words split at whitespace, quotes, its escapes, `#` starting a comment
    where a word would start, `\\c` ending the string; `${VAR}` is refused (not known here)."""
    words: list[str] = []
    current: list[str] = []
    started = False  # a word is open (an empty quoted one counts)
    quote = ""
    index = 0
    while index < len(text):
        char = text[index]
        index += 1
        piece: str | None = char
        if (char == "'" and quote != '"') or (char == '"' and quote != "'"):
            quote, piece = ("" if quote else char), ""
        elif char in _ENV_SPLIT_WHITESPACE and not quote:
            piece = None
        elif (char == "#" and not started and not quote) or (
            text.startswith("\\c", index - 1) and not quote
        ):
            break
        elif char == "$" and quote != "'":
            raise NotUnderstood(f"env -S {shown(text)} expands an environment variable")
        elif char == "\\" and not (quote == "'" and text[index : index + 1] not in ("\\", "'")):
            piece = _split_escape(text, text[index : index + 1], quote)
            index += 1
        if piece is None:
            if started:
                words.append("".join(current))
                current.clear()
            started = False
        else:
            current.append(piece)
            started = True
    if quote:
        raise NotUnderstood(f"env -S {shown(text)}: a quote is not closed")
    if started:
        words.append("".join(current))
    return words


def program_path(command: Command, exists=os.path.lexists) -> str:
    """The absolute path of the file a command runs: a bare name looked up in systemd's
    SEARCH_PATH (the first folder that holds it). NotUnderstood when no folder does."""
    if command.path.startswith("/"):
        return command.path
    for folder in SEARCH_PATH:
        candidate = os.path.join(folder, command.path)
        if exists(candidate):
            return candidate
    raise NotUnderstood(f"{shown(command.path)} is in none of systemd's {', '.join(SEARCH_PATH)}")
