"""Dump the real SGLang server's argparse flags as JSON (gpusim's flag table).

Run it with the reference venv's interpreter (built by scripts/sglang-reference-env.sh):

    .cache/sglang-ref/venv/bin/python gpusim/tools/dump_sglang_flags.py \
        --output gpusim/gpusim/flags/sglang-0.5.23.json

Another SGLang version's table, with the reference venv's dependencies: install that wheel
`--no-deps --target DIR` and put DIR first on the path, e.g. for 0.5.22 (a cp311 wheel, as the
reference venv's Python):

    PYTHONPATH=/tmp/sg522 .cache/sglang-ref/venv/bin/python gpusim/tools/dump_sglang_flags.py \
        --output gpusim/gpusim/flags/sglang-0.5.22.json

The recorded `sglang_version` is that of the distribution the imported `sglang` package comes
from, not whichever `sglang` distribution importlib.metadata finds first.

It builds the parser exactly as ``sglang.srt.server_args.prepare_server_args`` does
(``argparse.ArgumentParser(prog="sglang serve")`` + ``ServerArgs.add_cli_args``) and starts
nothing. Actions are kept in registration order, because that order is what argparse's usage and
help text follow; every mapping is written with sorted keys, so the file is byte-stable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PROG = "sglang serve"
# argparse wraps usage at the terminal width; fix it so the recorded usage does not depend on it.
USAGE_COLUMNS = 80

# argparse's own action classes, by the name `add_argument(action=...)` takes
# (BooleanOptionalAction has no such name: it is passed as the class).
_BUILTIN_ACTIONS: dict[type[argparse.Action], str] = {
    argparse._StoreAction: "store",
    argparse._StoreConstAction: "store_const",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._AppendAction: "append",
    argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
    argparse._HelpAction: "help",
    argparse._VersionAction: "version",
    argparse._ExtendAction: "extend",
    argparse.BooleanOptionalAction: "BooleanOptionalAction",
}
# Extra settings SGLang's own Deprecated*Action classes carry (srt/arg_groups/argparse_actions.py).
_CUSTOM_ACTION_ATTRS = ("new_flag", "const_value", "error_message")
# Converters SGLang passes as `type=`, by what their values look like. Others (human_readable_int
# takes "1k"/"2Gi", parse_cuda_graph_backend_arg rejects a retired name) are "custom".
_KIND_BY_CONVERTER = {
    "loads": "json",
    "json_list_type": "json",
    "parse_cuda_graph_config_arg": "json",
    "nullable_str": "str",
}


def json_safe(value: Any) -> Any:
    """A JSON value for a default/const/choice; sets become sorted lists (their order is random)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, set | frozenset):
        return sorted((json_safe(v) for v in value), key=repr)
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if hasattr(value, "value") and hasattr(value, "name"):  # enum members
        return json_safe(value.value)
    return repr(value)


def action_name(action: argparse.Action) -> str:
    """The built-in action an action behaves like on the command line.

    SGLang's own Deprecated*Action classes (srt/arg_groups/argparse_actions.py) and LoRAPathAction
    only add a warning or reshape the value, so a parser rebuilt from this file can use the
    built-in with the same arity; `action_class` keeps the real class name.
    """
    builtin = _BUILTIN_ACTIONS.get(type(action))
    if builtin is not None:
        return builtin
    if action.nargs == 0:
        return "store_const" if hasattr(action, "const_value") else "store_true"
    return "store"


def type_name(action: argparse.Action) -> str | None:
    """`int`, `float`, `str`, or `module.qualname` of a converter; None when argparse keeps text."""
    converter = action.type
    if converter is None:
        return None
    if converter in (int, float, str):
        return converter.__name__
    module = getattr(converter, "__module__", "") or ""
    return f"{module}.{getattr(converter, '__qualname__', repr(converter))}".lstrip(".")


def type_kind(action: argparse.Action) -> str:
    """What a validator checks a value as: int, float, str, bool (a switch), json or custom."""
    if action.nargs == 0:
        return "bool"
    converter = action.type
    if converter in (None, str):
        return "str"
    if converter in (int, float):
        return converter.__name__
    return _KIND_BY_CONVERTER.get(getattr(converter, "__name__", ""), "custom")


def describe(action: argparse.Action, order: int) -> dict[str, Any]:
    record: dict[str, Any] = {
        "order": order,
        "option_strings": list(action.option_strings),
        "dest": action.dest,
        "action": action_name(action),
        "action_class": type(action).__name__,
        "nargs": action.nargs,
        "const": json_safe(action.const),
        "default": json_safe(action.default),
        "type": type_name(action),
        "type_kind": type_kind(action),
        "choices": None if action.choices is None else json_safe(action.choices),
        "choices_unordered": isinstance(action.choices, set | frozenset),
        "required": action.required,
        "help": action.help,
        # argparse hides these from usage and help (help=SUPPRESS); they still parse.
        "help_suppressed": action.help == argparse.SUPPRESS,
        "metavar": json_safe(action.metavar),
    }
    for attr in _CUSTOM_ACTION_ATTRS:
        if hasattr(action, attr):
            record[attr] = json_safe(getattr(action, attr))
    return record


def build_server_parser() -> argparse.ArgumentParser:
    """The parser `python -m sglang.launch_server` / `sglang serve` parses argv with."""
    from sglang.srt.server_args import ServerArgs  # noqa: PLC0415 - needs the reference venv

    parser = argparse.ArgumentParser(prog=PROG)
    ServerArgs.add_cli_args(parser)
    return parser


def usage_text(parser: argparse.ArgumentParser) -> str:
    """Usage at a fixed width, with set-valued choices sorted (SGLang's own order is random)."""
    os.environ["COLUMNS"] = str(USAGE_COLUMNS)
    saved = {action: action.choices for action in parser._actions}
    try:
        for action, choices in saved.items():
            if isinstance(choices, set | frozenset):
                action.choices = sorted(choices)
        return parser.format_usage()
    finally:
        for action, choices in saved.items():
            action.choices = choices


def imported_sglang_version() -> str:
    """The version of the distribution that installed the `sglang` package Python imports.

    With a second SGLang shadowing the venv's (PYTHONPATH), two `sglang` distributions are
    visible; the one whose files hold the imported `sglang/__init__.py` is the parser's.
    """
    import sglang  # noqa: PLC0415 - needs the reference venv

    imported = Path(sglang.__file__).resolve()
    for dist in metadata.distributions(name="sglang"):
        if Path(str(dist.locate_file("sglang/__init__.py"))).resolve() == imported:
            return dist.version
    raise SystemExit(f"dump_sglang_flags: no sglang distribution owns {imported}")


def dump(parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {
        "sglang_version": imported_sglang_version(),
        "python_version": "{}.{}.{}".format(*sys.version_info[:3]),
        "prog": parser.prog,
        "entry_points": ["python -m sglang.launch_server", "sglang serve"],
        "allow_abbrev": parser.allow_abbrev,
        "usage_columns": USAGE_COLUMNS,
        "usage": usage_text(parser),
        # What argparse prints on a bad flag: usage, then this line, then exit 2.
        "error_format": "{usage}{prog}: error: {message}\n",
        "error_exit_code": 2,
        "actions": [describe(action, i) for i, action in enumerate(parser._actions)],
    }


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--output", type=Path, help="write here instead of standard output")
    args = cli.parse_args(argv)
    text = json.dumps(dump(build_server_parser()), indent=1, sort_keys=True) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
