"""SGLang's command-line flags, so the double accepts and rejects exactly what SGLang does.

The table comes from `flags/sglang-<version>.json` for the SGLang installed beside the double
(gpusim.version; the public part of its version, "0.5.23+regressed" -> 0.5.23), generated from
that SGLang's real parser (`python -m sglang.launch_server`'s argparse actions). An installed
version without a table is refused (exit 2, as argparse), never parsed with another version's
flags. Only for the pinned version (gpusim.SGLANG_VERSION) does a hand-written table of the
flags this project uses serve when its file is missing. `--config FILE.yaml` merges like
SGLang's ConfigArgumentMerger: file values go first, so the command line wins.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from decimal import Decimal
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from gpusim import SGLANG_VERSION
from gpusim.version import installed_sglang_version, public_version

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable  # Python 3.11+; annotations only

PROG = "sglang serve"  # SGLang 0.5.22 and 0.5.23 build their parsers with this prog name
KV_CACHE_DTYPES = [
    "auto",
    "fp8_e5m2",
    "fp8_e4m3",
    "mxfp8",
    "bf16",
    "bfloat16",
    "nvfp4",
    "fp4_mx_block16",
]

# Fallback table: (option strings, dest, type name or action, default, choices).
_HAND_TABLE: list[tuple[list[str], str, str, Any, list[Any] | None]] = [
    (["--model-path", "--model"], "model_path", "str", None, None),
    (["--tokenizer-path"], "tokenizer_path", "str", None, None),
    (["--trust-remote-code"], "trust_remote_code", "store_true", False, None),
    (["--context-length"], "context_length", "human_readable_int", None, None),
    (["--kv-cache-dtype"], "kv_cache_dtype", "str", "auto", KV_CACHE_DTYPES),
    (["--host"], "host", "str", "127.0.0.1", None),
    (["--port"], "port", "int", 30000, None),
    (["--served-model-name"], "served_model_name", "str", None, None),
    (["--api-key"], "api_key", "str", None, None),
    (["--tp-size", "--tensor-parallel-size"], "tp_size", "int", 1, None),
    (["--dp-size", "--data-parallel-size"], "dp_size", "int", 1, None),
    (["--pp-size", "--pipeline-parallel-size"], "pp_size", "int", 1, None),
    (["--nnodes"], "nnodes", "int", 1, None),
    (["--node-rank"], "node_rank", "int", 0, None),
    (["--dist-init-addr"], "dist_init_addr", "str", None, None),
    (["--mem-fraction-static"], "mem_fraction_static", "float", None, None),
    (["--max-running-requests"], "max_running_requests", "int", None, None),
    (["--max-total-tokens"], "max_total_tokens", "human_readable_int", None, None),
    (["--chunked-prefill-size"], "chunked_prefill_size", "int", None, None),
    (["--max-prefill-tokens"], "max_prefill_tokens", "human_readable_int", 16384, None),
    (["--page-size"], "page_size", "int", None, None),
    (["--num-continuous-decode-steps"], "num_continuous_decode_steps", "int", 1, None),
    (["--disable-custom-all-reduce"], "disable_custom_all_reduce", "store_true", False, None),
    (["--disable-cuda-graph"], "disable_cuda_graph", "store_true", False, None),
    (["--disable-radix-cache"], "disable_radix_cache", "store_true", False, None),
    (
        ["--enable-hierarchical-cache", "--enable-hicache"],
        "enable_hierarchical_cache",
        "store_true",
        False,
        None,
    ),
    (["--hicache-ratio"], "hicache_ratio", "float", None, None),
    (["--hicache-size"], "hicache_size", "int", 0, None),
    (
        ["--hicache-write-policy"],
        "hicache_write_policy",
        "str",
        "write_through",
        ["write_back", "write_through", "write_through_selective"],
    ),
    (
        ["--hicache-io-backend"],
        "hicache_io_backend",
        "str",
        "kernel",
        ["direct", "kernel", "kernel_ascend"],
    ),
    (
        ["--hicache-mem-layout"],
        "hicache_mem_layout",
        "str",
        "page_first",
        ["layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"],
    ),
    (["--log-level"], "log_level", "str", "info", None),
    (["--log-level-http"], "log_level_http", "str", None, None),
    (["--enable-metrics"], "enable_metrics", "store_true", False, None),
    (["--decode-log-interval"], "decode_log_interval", "int", 40, None),
    (["--skip-server-warmup"], "skip_server_warmup", "store_true", False, None),
    (["--config"], "config", "str", None, None),
]


def _str_to_bool(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean value: {value!r}")


_SI = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)")


def human_readable_int(value: str) -> int:
    """SGLang's `srt/utils/common.py` human_readable_int: 4096, 128k, 25.6k, 1Mi (case-sensitive).

    Named like SGLang's so argparse's messages name the same type.
    """
    value = value.strip()
    match = _SUFFIXED.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _IEC:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'. "
                    f"Use an integer IEC value such as '{int(Decimal(number))}{suffix}', "
                    f"or an SI value such as '{number}{suffix[0]}'."
                )
            return int(number) * _IEC[suffix]
        return int(Decimal(number) * _SI[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. "
            "Use a plain integer, SI suffixes (1k, 1M), or IEC suffixes (1Ki, 1Mi). "
            "Suffixes are case-sensitive."
        ) from None


def nullable_str(value: str) -> str | None:
    """SGLang's nullable_str: only an empty string or "None" mean None."""
    return None if not value or value == "None" else value


def json_list_type(value: str) -> Any:
    """SGLang's json_list_type, with its message for text that is not JSON."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"Invalid JSON list: {value}. Please provide a valid JSON list."
        ) from None


# Converters by the type name the flag table records (SGLang's own helpers by last name).
_TYPES: dict[str | None, Callable[[str], Any] | None] = {
    "int": int,
    "float": float,
    "str": str,
    None: None,
    "None": None,
    "str_to_bool": _str_to_bool,
    "bool": _str_to_bool,
    "json.loads": json.loads,
    "json_list_type": json_list_type,
    "human_readable_int": human_readable_int,
    "nullable_str": nullable_str,
}


def _converter(kind: str | None) -> Callable[[str], Any] | None:
    if kind in _TYPES:
        return _TYPES[kind]
    return _TYPES.get(kind.rsplit(".", 1)[-1], str) if kind else None


_ACTIONS = {
    "store",
    "store_true",
    "store_false",
    "store_const",
    "append",
    "append_const",
    "count",
    "extend",
}


class NoFlagTable(Exception):
    """The installed SGLang has no flag table in this package (and is not the pinned one)."""

    def __init__(self, version: str) -> None:
        public = public_version(version)
        shown = version if public == version else f"{version} (public version {public})"
        have = ", ".join(table_versions()) or "none"
        super().__init__(
            f"gpusim has no flag table for the installed sglang {shown}: no "
            f"flags/sglang-{public}.json in the gpusim package, which has tables for: {have}. "
            "Generate one with gpusim/tools/dump_sglang_flags.py (gpusim/README.md, "
            '"Versions").'
        )
        self.version = version


def _version_key(version: str) -> list[tuple[int, str]]:
    return [(int(part), "") if part.isdigit() else (-1, part) for part in version.split(".")]


def tables_dir() -> Traversable:
    """Where the package keeps its flag tables (`gpusim/flags/`)."""
    return resources.files("gpusim") / "flags"


def table_versions() -> list[str]:
    """The SGLang versions this package has flag tables for, oldest first."""
    folder = tables_dir()
    names = [entry.name for entry in folder.iterdir()] if folder.is_dir() else []
    versions = [
        name.removeprefix("sglang-").removesuffix(".json")
        for name in names
        if name.startswith("sglang-") and name.endswith(".json")
    ]
    return sorted(versions, key=_version_key)


def flag_table_json(version: str | None = None) -> list[dict[str, Any]] | None:
    """The generated flag table of an SGLang version (default: the installed one).

    None: the pinned version's file is missing, and the hand table serves. Any other version
    without a file raises NoFlagTable.
    """
    version = installed_sglang_version() if version is None else version
    public = public_version(version)
    resource = tables_dir() / f"sglang-{public}.json"
    if not resource.is_file():
        if public == SGLANG_VERSION:
            return None
        raise NoFlagTable(version)
    data = json.loads(resource.read_text())
    return data["actions"] if isinstance(data, dict) else data


def using_generated_table(version: str | None = None) -> bool:
    return flag_table_json(version) is not None


class DeprecatedStoreTrue(argparse.Action):
    """SGLang's DeprecatedStoreTrueAction: stores True and warns with the new spelling
    (srt/arg_groups/argparse_actions.py, `print_deprecated_warning`: a logger warning in bold
    yellow, which reaches stderr before logging is configured)."""

    def __init__(self, option_strings: list[str], dest: str, new_flag: str | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        self.new_flag = new_flag
        kwargs.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        replacement = f" Use '{self.new_flag}' instead." if self.new_flag else ""
        message = f"'{option_string}' is deprecated and will be removed in a future release."
        print(f"\033[1;33m{message}{replacement}\033[0m", file=sys.stderr)
        setattr(namespace, self.dest, True)


def _add_from_json(parser: argparse.ArgumentParser, entry: dict[str, Any]) -> None:
    options = entry.get("option_strings") or []
    action = entry.get("action") or "store"
    action = (
        action.removeprefix("_").removesuffix("Action").lower() if "Action" in action else action
    )
    if not options or "-h" in options or action in ("help", "version"):
        return
    # SGLang hides some flags from --help and usage (argparse.SUPPRESS, matched by identity).
    help_text = argparse.SUPPRESS if entry.get("help_suppressed") else entry.get("help")
    kwargs: dict[str, Any] = {"dest": entry["dest"], "help": help_text}
    if entry.get("required"):
        kwargs["required"] = True
    if action == "booleanoptional":
        # The table lists the generated --no-X too; argparse derives it again from --X.
        options = [o for o in options if not o.startswith("--no-")] or options
        kwargs["action"] = argparse.BooleanOptionalAction
        kwargs["default"] = entry.get("default")
    else:
        kwargs["action"] = {"storetrue": "store_true", "storefalse": "store_false"}.get(
            action.replace("_", ""), action if action in _ACTIONS else "store"
        )
        kwargs["default"] = entry.get("default")
    if kwargs["action"] in ("store", "append", "extend"):
        converter = _converter(entry.get("type"))
        if converter is not None:
            kwargs["type"] = converter
        if entry.get("nargs") is not None:
            kwargs["nargs"] = entry["nargs"]
        if entry.get("choices") is not None:
            kwargs["choices"] = entry["choices"]
        if entry.get("metavar") is not None:
            kwargs["metavar"] = entry["metavar"]
    if kwargs["action"] == "store_const":
        kwargs["const"] = entry.get("const")
    if entry.get("action_class") == "DeprecatedStoreTrueAction":
        kwargs["action"] = DeprecatedStoreTrue
        kwargs["new_flag"] = entry.get("new_flag")
    parser.add_argument(*options, **kwargs)


def build_parser(version: str | None = None) -> argparse.ArgumentParser:
    """SGLang's parser for `version` (default: the installed SGLang's).

    A version without a flag table exits 2 with argparse's usage and error lines, naming the
    version and the tables there are: `--help` and start-up both fail that way.
    """
    parser = argparse.ArgumentParser(prog=PROG)
    try:
        table = flag_table_json(version)
    except NoFlagTable as exc:
        parser.error(str(exc))
    if table is not None:
        for entry in table:
            _add_from_json(parser, entry)
        if "--config" not in parser._option_string_actions:
            parser.add_argument("--config", dest="config", default=None)
        return parser
    for options, dest, kind, default, choices in _HAND_TABLE:
        if dest == "model_path":
            parser.add_argument(*options, dest=dest, required=True)
        elif kind == "store_true":
            parser.add_argument(*options, dest=dest, action="store_true", default=default)
        else:
            parser.add_argument(
                *options, dest=dest, type=_TYPES[kind], default=default, choices=choices
            )
    return parser


def _config_keys(action: argparse.Action) -> set[str]:
    return {action.dest} | {
        opt[2:].replace("-", "_") for opt in action.option_strings if opt.startswith("--")
    }


def merge_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """SGLang's ConfigArgumentMerger: YAML values become flags placed before the CLI's."""
    if "--config" not in argv:
        return argv
    if argv.count("--config") > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    index = argv.index("--config")
    if index == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = argv[index + 1]
    if not path.lower().endswith((".yaml", ".yml")):
        raise ValueError(f"Config file must be YAML format, got: .{path.rsplit('.', 1)[-1]}")
    try:
        with open(path) as handle:
            data = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise ValueError(f"Config file not found: {path}") from None
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    store_true = {
        key
        for action in parser._actions
        if isinstance(action, argparse._StoreTrueAction)
        for key in _config_keys(action)
    }
    return _config_to_args(data, store_true) + argv[:index] + argv[index + 2 :]


def _config_to_args(data: dict[str, Any], store_true: set[str]) -> list[str]:
    args: list[str] = []
    for key, value in data.items():
        if isinstance(value, bool):
            if key.replace("-", "_") in store_true:
                args += [f"--{key}"] if value else []
            else:
                args += [f"--{key}", str(value).lower()]
        elif isinstance(value, list):
            args += [f"--{key}", *(str(v) for v in value)] if value else []
        elif isinstance(value, dict):
            args += [f"--{key}", json.dumps(value)]
        else:
            args += [f"--{key}", str(value)]
    return args


def parse_server_args(argv: Sequence[str], version: str | None = None) -> argparse.Namespace:
    """Parse like `prepare_server_args` of `version` (default: the installed SGLang):
    argparse errors exit 2 with usage and message."""
    parser = build_parser(version)
    merged = merge_config(parser, list(argv))
    return parser.parse_args(merged)
