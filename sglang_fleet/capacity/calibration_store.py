"""The calibration store on the host: its file read (damaged entries set aside and named,
never dropped quietly), a record added, secrets cleaned out, the file written back
(`read_store`, `store_update`, `dump_store`; docs/CALIBRATION.md, "The store").
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sglang_fleet.capacity.calibration import STORE_LIMIT, STORE_SCHEMA, CalibrationError, timestamp
from sglang_fleet.capacity.calibration_record import public_record, without_values
from sglang_fleet.capacity.calibration_rule import no_constant, record_problem
from sglang_fleet.module_utils import bounded_json
from sglang_fleet.module_utils.typed_number import shown

SET_ASIDE_TEXT_CHARS = 65536
# A store holds STORE_LIMIT records; a file of more entries than this is no store this project
# wrote, and is set aside whole rather than entry by entry. A warning names this many entries.
MAX_STORE_ENTRIES = 1024
PROBLEMS_NAMED = 8


@dataclass(frozen=True)
class SetAside:
    """One entry of the store that no plan may use, and why (`entry`: its index, or None when
    the file as a whole is no store)."""

    entry: int | None
    problem: str
    content: Any

    def describe(self) -> str:
        where = "the whole file" if self.entry is None else f"record {self.entry}"
        if isinstance(self.content, Mapping):
            made = self.content.get("recorded_at")
            where += f" (recorded {made[:64]})" if isinstance(made, str) else ""
        return f"{where}: {self.problem}"


@dataclass(frozen=True)
class StoreRead:
    """The store as read: the records a plan may use, and the entries set aside."""

    records: list[dict[str, Any]]
    set_aside: list[SetAside]

    def problems(self) -> str:
        """One line naming the entries set aside ("" when none), the first
        PROBLEMS_NAMED of them."""
        named = "; ".join(s.describe() for s in self.set_aside[:PROBLEMS_NAMED])
        more = len(self.set_aside) - PROBLEMS_NAMED
        return named + (f"; and {more} more" if more > 0 else "")


def _whole_file(problem: str, text: Any) -> StoreRead:
    content = text.decode(errors="replace") if isinstance(text, bytes) else text
    content = content[:SET_ASIDE_TEXT_CHARS] if isinstance(content, str) else _said_repr(content)
    return StoreRead([], [SetAside(None, problem, content)])


def read_store(text: str | bytes | Mapping | list | None) -> StoreRead:
    """The records of the store file (JSON text, parsed, or empty/missing = none).

    Every entry must be a record of this schema with finite, physical figures
    (record_problem). One that is not is set aside and named, never dropped quietly; the good
    entries stay usable, so one damaged entry is never why a healthy host cannot be deployed.
    A file that is no store at all (not JSON, another schema) is set aside whole."""
    if text is None or (isinstance(text, str | bytes) and not text.strip()):
        return StoreRead([], [])
    try:
        data = (
            bounded_json.loads(text, "the calibration store", parse_constant=no_constant)
            if isinstance(text, str | bytes)
            else text
        )
    except ValueError as exc:  # bounded_json: not JSON, or nested past its depth
        problem = str(exc).removeprefix("the calibration store: ")
        if not problem.startswith("not JSON"):
            problem = f"not JSON ({problem})"
        return _whole_file(problem[:200], text)
    if isinstance(data, Mapping) and "records" in data:
        if data.get("schema") != STORE_SCHEMA:
            schema = shown(data.get("schema"))
            return _whole_file(f"store schema {schema}, not {STORE_SCHEMA!r}", text)
        data = data["records"]
    elif isinstance(data, Mapping):
        data = [data]
    if not isinstance(data, list):
        return _whole_file("a calibration store holds {schema, records: [...]}", text)
    if len(data) > MAX_STORE_ENTRIES:
        return _whole_file(
            f"{len(data)} entries, more than a store holds ({MAX_STORE_ENTRIES})", text
        )
    records, set_aside = [], []
    for index, entry in enumerate(data):
        problem = record_problem(entry)
        if problem:
            set_aside.append(SetAside(index, problem, entry))
        else:
            records.append(dict(entry))
    return StoreRead(records, set_aside)


def dump_store(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return {"schema": STORE_SCHEMA, "records": [dict(r) for r in records]}


SET_ASIDE_SCHEMA = "sglang-fleet/calibrations-set-aside/1"


def dump_set_aside(read: StoreRead, store_path: str, when: str | None = None) -> dict[str, Any]:
    """The side file that keeps what the store set aside, for the operator to look at (an
    entry JSON cannot hold, a NaN in a record given as data, is kept as its text)."""
    return {
        "schema": SET_ASIDE_SCHEMA,
        "store": store_path,
        "set_aside_at": when or timestamp(),
        "entries": [
            {"entry": s.entry, "problem": s.problem, "content": _as_json(s.content)}
            for s in read.set_aside
        ],
    }


def _as_json(content: Any) -> Any:
    if bounded_json.depth_problem(content, bounded_json.MAX_DEPTH - 4):
        return shown(content)
    try:
        json.dumps(content, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return _said_repr(content)
    return content


def _said_repr(content: Any) -> str:
    try:
        return repr(content)[:SET_ASIDE_TEXT_CHARS]
    except (ValueError, RecursionError):  # a huge integer inside, or nesting repr gives up on
        return shown(content)


def _same_setting(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("server") == b.get("server") and a.get("key") == b.get("key")


def add_record(
    records: Iterable[Mapping[str, Any]], record: Mapping[str, Any], limit: int = STORE_LIMIT
) -> list[dict[str, Any]]:
    """The newest record first; an older one of the same flag set is replaced. A record the
    store's reader would set aside is refused (CalibrationError), never written."""
    problem = record_problem(record)
    if problem:
        raise CalibrationError(f"the record would not be read back: {problem}")
    kept = [dict(r) for r in records if not _same_setting(r, record)]
    return [dict(record), *kept][:limit]


# A secret value shorter than this is not looked for inside other text: the server's key is
# long, and a short one ("a") would be found in every name ("auto") and damage the record.
MIN_SECRET_VALUE_CHARS = 8


def _cleaned(read: StoreRead, secrets: tuple[str, ...]) -> StoreRead:
    """The store as read, its secrets removed (public_record) from every record kept and every
    entry set aside; a record that the cleaning leaves unusable is set aside and named."""
    records, set_aside = [], []
    for index, record in enumerate(read.records):
        public = public_record(record, secrets)
        problem = record_problem(public)
        if problem:
            set_aside.append(SetAside(index, f"after its secrets were removed: {problem}", public))
        else:
            records.append(public)
    for entry in read.set_aside:
        content = entry.content
        if isinstance(content, str):
            content = without_values(content, secrets)
        else:
            content = public_record(content, secrets)
        set_aside.append(SetAside(entry.entry, entry.problem, content))
    return StoreRead(records, set_aside)


def store_update(
    store: Any,
    record: Mapping[str, Any],
    path: str = "calibration.json",
    server: str = "?",
    secrets: Iterable[str] = (),
) -> dict[str, Any]:
    """What the record step of a healthy start writes (docs/CALIBRATION.md, "The store"):

    {store: the store with `record` first, to write to `path`;
     record: `record` as the store holds it (cleaned of secrets), or None when it is not kept;
     set_aside: the side file's content (dump_set_aside), or None;
     set_aside_path: where it goes, beside the store;
     warning: which entries were set aside and why (naming the file and the server), or None}.

    Entries of the file on the host that no plan may use are moved to the side file, the good
    ones kept: the step never fails the start, and never drops what it cannot read unseen.
    Every record kept, written before or now, is cleaned of secrets (public_record: secret
    flags, entries named like a secret at any depth, and the `secrets` values themselves,
    the server's key as the record step knows it): the store is world-readable."""
    values = tuple(s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_VALUE_CHARS)
    read = _cleaned(read_store(store if store not in (None, "") else None), values)
    problems = [] if not read.set_aside else [read.problems()]
    kept: dict[str, Any] | None = public_record(record, values)
    try:
        records = add_record(read.records, kept)
    except CalibrationError as exc:
        records, kept = read.records, None
        problems.append(f"this start's record is not kept: {exc}")
    set_aside, side_path = None, None
    if read.set_aside:
        stamp = timestamp().replace("-", "").replace(":", "")
        folder, name = posixpath.split(str(path))
        side_path = posixpath.join(folder, f"{posixpath.splitext(name)[0]}.set-aside-{stamp}.json")
        set_aside = dump_set_aside(read, str(path))
    warning = None
    if problems:
        moved = f"; set aside in {side_path}" if side_path else ""
        warning = without_values(
            f"{path} (calibrations of server {server}): {' | '.join(problems)}{moved}; "
            f"{len(records)} record(s) kept",
            values,
        )
    return {
        "store": dump_store(records),
        "record": kept,
        "set_aside": set_aside,
        "set_aside_path": side_path,
        "warning": warning,
    }
