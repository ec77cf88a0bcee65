"""Every compiled regular expression the product modules hold, how the product calls it, and
strings built from its own literal pieces: what tests/test_props_regex.py times (a cheap
detector of backtracking) and tests/test_regex_validators.py reads for a `$`.

The product is sglang_fleet/, plugins/module_utils/, plugins/modules/, plugins/action/ and
plugins/filter/.
"""

from __future__ import annotations

import importlib
import itertools
import re
import re._constants as sre_constants
import re._parser as sre_parser
from dataclasses import dataclass
from functools import cache

from conftest import ROOT, load_plugin

PRODUCT = (
    "sglang_fleet",
    "plugins/module_utils",
    "plugins/modules",
    "plugins/action",
    "plugins/filter",
)
# How an expression is called -> the call a test times: whatever scans the whole string
# (findall, finditer, sub, split) costs what findall costs.
_CALLS = {
    "search": "search",
    "match": "match",
    "fullmatch": "fullmatch",
    "findall": "findall",
    "finditer": "findall",
    "sub": "findall",
    "subn": "findall",
    "split": "findall",
}
_CALL = re.compile(r"\b(\w+)\.(" + "|".join(_CALLS) + r")\(")


@dataclass(frozen=True)
class ProductRegex:
    file: str
    name: str
    pattern: re.Pattern[str]
    calls: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}: {self.name}"


def _modules() -> list[tuple[str, object]]:
    found = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if folder not in ("sglang_fleet", "plugins/module_utils"):
                found.append((relative, load_plugin(relative)))
                continue
            name = relative.removesuffix(".py").replace("/", ".")
            if name.endswith((".__init__", ".__main__")):
                continue
            # pyproject.toml maps plugins/module_utils/ as sglang_fleet.module_utils.
            name = name if folder == "sglang_fleet" else f"sglang_fleet.module_utils.{path.stem}"
            found.append((relative, importlib.import_module(name)))
    return found


def _calls_in(text: str) -> dict[str, set[str]]:
    calls: dict[str, set[str]] = {}
    for name, call in _CALL.findall(text):
        calls.setdefault(name, set()).add(_CALLS[call])
    return calls


@cache
def product_regexes() -> tuple[ProductRegex, ...]:
    """Each module-level expression once (an imported one where it is first seen), with the
    calls its own file makes on it; when it makes none (the expression is handed to a helper,
    or imported elsewhere), every call of the whole product, or search, match and fullmatch."""
    modules = _modules()
    texts = {relative: (ROOT / relative).read_text() for relative, _ in modules}
    everywhere = _calls_in("\n".join(texts.values()))
    found, seen = [], set()
    for relative, module in modules:
        own = _calls_in(texts[relative])
        for name, value in vars(module).items():
            if not isinstance(value, re.Pattern) or id(value) in seen:
                continue
            seen.add(id(value))
            calls = own.get(name) or everywhere.get(name) or {"search", "match", "fullmatch"}
            found.append(ProductRegex(relative, name, value, tuple(sorted(calls))))
    return tuple(found)


# --------------------------------------------------------------------------- reading one


def _children(op: object, av: object) -> list[sre_parser.SubPattern]:
    if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT):
        return [av[2]]
    if op in (sre_constants.SUBPATTERN, sre_constants.ATOMIC_GROUP):
        return [av[-1]]
    if op is sre_constants.BRANCH:
        return list(av[1])
    if op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
        return [av[1]]
    return []


def takes_a_last_newline(pattern: re.Pattern[str]) -> bool:
    """Whether the expression holds `$` outside MULTILINE: "the end, or before a last newline"."""

    def holds(tree: sre_parser.SubPattern) -> bool:
        return any(
            (op is sre_constants.AT and av is sre_constants.AT_END)
            or any(holds(child) for child in _children(op, av))
            for op, av in tree
        )

    return not pattern.flags & re.MULTILINE and holds(
        sre_parser.parse(pattern.pattern, pattern.flags)
    )


# A character each class names, for strings that the class matches.
_CATEGORY = {
    sre_constants.CATEGORY_DIGIT: "7",
    sre_constants.CATEGORY_NOT_DIGIT: "a",
    sre_constants.CATEGORY_SPACE: " ",
    sre_constants.CATEGORY_NOT_SPACE: "a",
    sre_constants.CATEGORY_WORD: "a",
    sre_constants.CATEGORY_NOT_WORD: " ",
}


def literal_pieces(pattern: re.Pattern[str]) -> list[str]:
    """The expression's literal runs and one character of each class, in order of appearance."""
    pieces: list[str] = []

    def add(piece: str) -> None:
        if piece and piece not in pieces:
            pieces.append(piece)

    def walk(tree: sre_parser.SubPattern) -> None:
        run = ""
        for op, av in tree:
            if op is sre_constants.LITERAL:
                run += chr(av)
                continue
            add(run)
            run = ""
            if op is sre_constants.IN:
                for kind, value in av:
                    if kind is sre_constants.LITERAL:
                        add(chr(value))
                    elif kind is sre_constants.RANGE:
                        add(chr(value[0]))
                    elif kind is sre_constants.CATEGORY:
                        add(_CATEGORY.get(value, "a"))
            elif op is sre_constants.ANY:
                add("x")
            for child in _children(op, av):
                walk(child)
        add(run)

    walk(sre_parser.parse(pattern.pattern, pattern.flags))
    return pieces


def adversarial_units(pattern: re.Pattern[str]) -> list[str]:
    """Short strings whose repetition makes a backtracking expression slow: each piece, each
    two neighbouring pieces, each piece before and after the first, each piece with a blank,
    and all pieces in order."""
    pieces = literal_pieces(pattern)
    first = pieces[:1] * len(pieces)
    units = [
        *pieces,
        *(a + b for a, b in itertools.pairwise(pieces)),
        *(a + b for a, b in zip(pieces, first, strict=True)),
        *(b + a for a, b in zip(pieces, first, strict=True)),
        *(piece + " " for piece in pieces),
        "".join(pieces),
    ]
    return list(dict.fromkeys(units))


def repeated(unit: str, chars: int) -> str:
    return (unit * (chars // max(1, len(unit)) + 1))[:chars]
