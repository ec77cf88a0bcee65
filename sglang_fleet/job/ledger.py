"""Where a job's rows end, exactly once (docs/JOB.md, "Exactly once").

A job writes three files its readers know (SpecForge's names): OUT (the rows that succeeded),
OUT_error and OUT_skipped (the same stem with `_error` and `_skipped` before the suffix), and
one of its own, OUT.ledger: an append-only list of which row ended in which file, at which
offset. A finished row is one ledger line `{"key", "file", "end", "length", "sha"}` saying
where its line will be, then one write of that whole line to its file. Every `sync_every` rows
(and at the end) the three files are fsync'd, then a sync mark `{"synced": {file: end}}` is
written and the ledger fsync'd: what lies before the last mark is on disk whatever happens to
the machine.

Opening a ledger again (resume, the default) reconciles it with the files before anything is
sent, so that a SIGKILL or a reboot at any instant leaves every row in exactly one place:
- a torn last ledger line is cut off;
- ledger entries past the last sync mark are checked against their file (the line at
  [end - length, end) must be whole and hash to `sha`); from the first that is not there (a
  kill between the ledger line and the row's write, or a reboot that lost either), that file's
  later entries are dropped: those rows run again;
- whatever a file holds past its last entry that stands (a partial line, a line whose ledger
  line a reboot lost) is cut off: a row is in a file only where the ledger says so.
A write that fails (a full disk) cuts the file back to where it was and stops the run: nothing
is half-written, and the row runs again on resume.

An error row's entry also names its class (`"class": "timeout"`, calls.py's classes), so that
`status` counts the job's errors by class, and finds its last error, from the ledger alone.

The first ledger line holds the input's identity (path, size, SHA-256) and the job's settings'
digest: the same output with another input is refused, never mixed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sglang_fleet.job.rows import MAX_ROW_BYTES
from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

SCHEMA = "sglang-fleet/job-ledger/1"
FILES = ("output", "error", "skipped")
MAX_LEDGER_LINE = 64 * 1024
MAX_USAGE_PAIRS = 256  # calls of one row whose lengths are kept (a conversation's turns)
# How long opening a job waits for its lock: `status` holds it for an instant to tell whether a
# run holds it (held()); another run holds it for good and is refused after this.
LOCK_WAIT_S = 2.0
MAX_CLASS_CHARS = 40
# The longest line read back (read_line): an input row at its bound with what a run adds to it.
MAX_WRITTEN_LINE = 2 * MAX_ROW_BYTES


class LedgerError(Exception):
    """The job cannot go on with these files (the message says which and why)."""


def file_paths(output: str) -> dict[str, str]:
    """{output, error, skipped, ledger}: SpecForge's names beside the output."""
    stem, dot, suffix = output.rpartition(".")
    if not dot or "/" in suffix:
        stem, suffix = output, "jsonl"
    return {
        "output": output,
        "error": f"{stem}_error.{suffix}",
        "skipped": f"{stem}_skipped.{suffix}",
        "ledger": f"{output}.ledger",
    }


def _sha(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()[:16]


@dataclass
class Entry:
    key: str
    file: str
    end: int
    length: int
    sha: str
    at: int = 0  # where its line starts in the ledger
    # (prompt tokens, completion tokens) of each of the row's calls: the job's real lengths,
    # which `python -m sglang_fleet.job shape` samples for the gate and autotune.
    usage: tuple[tuple[int, int], ...] = ()
    why: str | None = None  # an error row's class

    def line(self) -> dict[str, Any]:
        line = {"key": self.key, "file": self.file, "end": self.end, "length": self.length,
                "sha": self.sha}  # fmt: skip
        if self.usage:
            line["usage"] = [list(pair) for pair in self.usage]
        if self.why:
            line["class"] = self.why
        return line


@dataclass
class Reconciled:
    """What opening the ledger found and did (said in the run's first lines)."""

    done: int = 0
    redone: int = 0
    cut_bytes: dict[str, int] = field(default_factory=dict)


class Ledger:
    """The job's output files and its ledger, held open for appending under a lock."""

    def __init__(self, output: str, identity: dict[str, Any], sync_every: int = 64) -> None:
        self.paths = file_paths(output)
        self.identity = identity
        self.sync_every = max(1, sync_every)
        self.entries: dict[str, Entry] = {}
        self.counts = dict.fromkeys(FILES, 0)
        self.error_classes: Counter[str] = Counter()
        self.ends = dict.fromkeys(FILES, 0)
        self._fds: dict[str, int] = {}
        self._unsynced = 0
        self._lock_fd: int | None = None
        self.reconciled = Reconciled()

    # --- opening ------------------------------------------------------------------------
    def open(self) -> Reconciled:
        """Lock, read and reconcile the ledger, open every file for appending; a refusal
        leaves nothing open and no lock held."""
        self._lock()
        try:
            return self._open_locked()
        except BaseException:
            self._release()
            raise

    def _open_locked(self) -> Reconciled:
        for name in (*FILES, "ledger"):
            path = self.paths[name]
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
            except OSError as exc:
                raise LedgerError(f"{path}: cannot open it ({exc.strerror})") from None
            if not _regular(fd):
                os.close(fd)
                raise LedgerError(f"{path}: not a regular file")
            self._fds[name] = fd
        header, entries, synced = self._read_ledger()
        if header is None:
            held = [self.paths[f] for f in FILES if self._size(f)]
            if held:
                raise LedgerError(
                    f"{', '.join(held)} hold rows but {self.paths['ledger']} says nothing of "
                    "them: not this job's output; name a new output"
                )
            self._append_ledger({"schema": SCHEMA, "identity": self.identity})
        self._reconcile(entries, synced)
        self.sync()
        return self.reconciled

    def _lock(self) -> None:
        path = self.paths["ledger"] + ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                raise LedgerError(
                    f"another run of this job holds {path}: one run of a job at a time"
                ) from None
        self._lock_fd = fd

    def _size(self, name: str) -> int:
        return os.fstat(self._fds[name]).st_size

    def _read_ledger(self) -> tuple[dict[str, Any] | None, list[Entry], dict[str, int]]:
        """The header, the entries (each with its offset in the ledger) and the last sync mark;
        checks the header against this job. A torn or foreign last line is cut."""
        fd = self._fds["ledger"]
        size = os.fstat(fd).st_size
        entries: list[Entry] = []
        synced = dict.fromkeys(FILES, 0)
        offset, header = 0, None
        with os.fdopen(os.dup(fd), "rb") as handle:
            handle.seek(0)
            while raw := handle.readline(MAX_LEDGER_LINE + 1):
                record = _record(raw) if raw.endswith(b"\n") else None
                if record is None:
                    break  # torn by a kill, or not ours: cut below
                if header is None:
                    self._check_header(record)
                    header = record
                elif "synced" in record:
                    synced = record["synced"]
                else:
                    fields = {k: record[k] for k in ("key", "file", "end", "length", "sha")}
                    usage = tuple(tuple(pair) for pair in record.get("usage") or ())
                    entries.append(Entry(**fields, at=offset, usage=usage, why=_class(record)))
                offset += len(raw)
        if offset < size:
            self.reconciled.cut_bytes["ledger"] = size - offset
            os.ftruncate(fd, offset)
        return header, entries, synced

    def _check_header(self, header: dict[str, Any]) -> None:
        if header.get("schema") != SCHEMA:
            raise LedgerError(f"{self.paths['ledger']}: not a job ledger of this version")
        theirs, ours = header.get("identity") or {}, self.identity
        if theirs.get("input_sha256") != ours.get("input_sha256"):
            raise LedgerError(
                f"{self.paths['output']} holds the rows of another input "
                f"({theirs.get('input_path')}, sha256 {str(theirs.get('input_sha256'))[:12]}...): "
                "one output per input; name a new output to start another job"
            )
        if theirs.get("settings") != ours.get("settings"):
            raise LedgerError(
                f"{self.paths['output']} was written with other job settings "
                f"({theirs.get('settings')} against {ours.get('settings')}): rows of one job "
                "are generated alike; name a new output to change them"
            )

    def _reconcile(self, entries: list[Entry], synced: dict[str, int]) -> None:
        """See the module docstring. What the last sync mark covers is on disk and trusted;
        each later entry must find its line right after the one before it in its file. From
        the first that does not, the ledger is cut (those rows run again), and every file
        ends where its last standing entry does."""
        ends = dict(synced)
        for number, entry in enumerate(entries):
            if entry.end <= synced[entry.file]:
                self._take(entry)
            elif entry.end - entry.length == ends[entry.file] and self._holds(entry):
                self._take(entry)
                ends[entry.file] = entry.end
            else:
                self.reconciled.redone = len(entries) - number
                cut = os.fstat(self._fds["ledger"]).st_size - entry.at
                self.reconciled.cut_bytes["ledger"] = (
                    self.reconciled.cut_bytes.get("ledger", 0) + cut
                )
                os.ftruncate(self._fds["ledger"], entry.at)
                break
        for name in FILES:
            if synced[name] > self._size(name):  # a sync mark vouches for what is gone
                raise LedgerError(
                    f"{self.paths[name]} is {self._size(name)} bytes, but the ledger synced "
                    f"{synced[name]}: the file was changed by something else; restore it or "
                    "name a new output"
                )
            self.ends[name] = ends[name]
            self._cut(name)

    def _holds(self, entry: Entry) -> bool:
        if entry.length <= 0 or entry.end > self._size(entry.file):
            return False
        data = os.pread(self._fds[entry.file], entry.length, entry.end - entry.length)
        return data.endswith(b"\n") and _sha(data) == entry.sha

    def _cut(self, name: str) -> None:
        """The file ends where its last standing entry does."""
        size, end = self._size(name), self.ends[name]
        if end < size:
            self.reconciled.cut_bytes[name] = size - end
            os.ftruncate(self._fds[name], end)

    def _take(self, entry: Entry) -> None:
        if entry.key in self.entries:
            raise LedgerError(f"{self.paths['ledger']} names row {entry.key!r} twice")
        self._count(entry)
        self.reconciled.done += 1

    def _count(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.counts[entry.file] += 1
        if entry.file == "error":
            self.error_classes[entry.why or "unknown"] += 1

    # --- writing ------------------------------------------------------------------------
    def done(self, key: str) -> bool:
        return key in self.entries

    def record(
        self,
        key: str,
        file: str,
        line: bytes,
        *,
        usage: list[tuple[int, int]] | None = None,
        why: str | None = None,
    ) -> None:
        """One finished row: its ledger entry, then its line; a failed write is undone.
        `usage`: each call's (prompt, completion) tokens; `why`: an error row's class."""
        if key in self.entries:
            raise LedgerError(f"row {key!r} was already written ({self.entries[key].file})")
        fd, start = self._fds[file], self.ends[file]
        kept = tuple((int(p), int(c)) for p, c in (usage or [])[:MAX_USAGE_PAIRS])
        why = _class({"class": why}) if file == "error" else None
        entry = Entry(key, file, start + len(line), len(line), _sha(line), usage=kept, why=why)
        ledger_start = os.fstat(self._fds["ledger"]).st_size
        self._append_ledger(entry.line())
        try:
            _write_all(fd, line)
        except OSError as exc:
            os.ftruncate(fd, start)
            os.ftruncate(self._fds["ledger"], ledger_start)
            raise LedgerError(_write_error(self.paths[file], exc)) from None
        self.ends[file] = entry.end
        self._count(entry)
        self._unsynced += 1
        if self._unsynced >= self.sync_every:
            self.sync()

    def _append_ledger(self, record: dict[str, Any]) -> None:
        fd = self._fds["ledger"]
        start = os.fstat(fd).st_size
        data = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        try:
            _write_all(fd, data)
        except OSError as exc:
            os.ftruncate(fd, start)
            raise LedgerError(_write_error(self.paths["ledger"], exc)) from None

    def sync(self) -> None:
        """Every file on disk, then the sync mark that says so."""
        try:
            for name in FILES:
                os.fsync(self._fds[name])
            self._append_ledger({"synced": dict(self.ends)})
            os.fsync(self._fds["ledger"])
        except OSError as exc:
            raise LedgerError(_write_error(self.paths["ledger"], exc)) from None
        self._unsynced = 0

    def close(self) -> None:
        try:
            if self._fds:
                self.sync()
        finally:
            self._release()

    def _release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _regular(fd: int) -> bool:
    import stat  # noqa: PLC0415 (one use)

    return stat.S_ISREG(os.fstat(fd).st_mode)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_error(path: str, exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"{path}: the disk is full; nothing was half-written, and the rows not yet "
            "written run again when the job is resumed"
        )
    return f"{path}: cannot write ({exc.strerror})"


def _record(raw: bytes) -> dict[str, Any] | None:
    try:
        record = bounded_loads(raw, "ledger line")
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if "schema" in record:
        return record
    if "synced" in record:
        marks = record["synced"]
        good = isinstance(marks, dict) and all(
            isinstance(marks.get(f), int) and not isinstance(marks.get(f), bool) and marks[f] >= 0
            for f in FILES
        )
        return record if good else None
    usage = record.get("usage", [])
    valid = (
        isinstance(record.get("key"), str)
        and record.get("file") in FILES
        and all(_count(record.get(k)) for k in ("end", "length"))
        and isinstance(record.get("sha"), str)
        and isinstance(usage, list)
        and len(usage) <= MAX_USAGE_PAIRS
        and all(
            isinstance(pair, list) and len(pair) == 2 and all(_tokens(n) for n in pair)
            for pair in usage
        )
    )
    return record if valid else None


@dataclass
class OnRecord:
    """What a job's ledger holds, read without its lock (a running job keeps writing)."""

    identity: dict[str, Any]
    counts: dict[str, int]
    errors_by_class: Counter[str]
    last_error: Entry | None

    @property
    def total(self) -> int:
        return int(self.identity.get("rows") or 0)


def read_record(output: str) -> OnRecord | None:
    """The ledger's header, its rows by file, its errors by class and its last error entry;
    None without a ledger. Only whole lines count, each row once."""
    path = file_paths(output)["ledger"]
    found = OnRecord({}, dict.fromkeys(FILES, 0), Counter(), None)
    seen: set[str] = set()
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(iter(lambda: handle.readline(MAX_LEDGER_LINE + 1), b"")):
                record = _record(raw) if raw.endswith(b"\n") else None
                if record is None:
                    break
                if number == 0:
                    found.identity = record.get("identity") or {}
                elif "key" in record and record["key"] not in seen:
                    seen.add(record["key"])
                    found.counts[record["file"]] += 1
                    if record["file"] == "error":
                        fields = {k: record[k] for k in ("key", "file", "end", "length", "sha")}
                        found.last_error = Entry(**fields, why=_class(record))
                        found.errors_by_class[found.last_error.why or "unknown"] += 1
    except OSError:
        return None
    return found


def read_counts(output: str) -> dict[str, int] | None:
    """{output, error, skipped, total} as the ledger says (read_record)."""
    found = read_record(output)
    return None if found is None else {**found.counts, "total": found.total}


def read_line(output: str, entry: Entry) -> dict[str, Any] | None:
    """The row an entry names, read from its file and checked against the entry's hash; None
    when the file does not hold it (yet: a running job writes the entry first)."""
    if entry.length > MAX_WRITTEN_LINE:
        return None
    try:
        with open(file_paths(output)[entry.file], "rb") as handle:
            handle.seek(entry.end - entry.length)
            data = handle.read(entry.length)
    except OSError:
        return None
    if len(data) != entry.length or _sha(data) != entry.sha:
        return None
    try:
        row = bounded_loads(data, f"{entry.file} row {entry.key}")
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def held(output: str) -> bool | None:
    """Whether a run of this job holds its lock now (a run that was killed, or whose host went
    down, holds nothing); None when the lock cannot be tried (not readable by this user). The
    lock is taken shared for an instant: a run starting then waits for it (LOCK_WAIT_S)."""
    path = file_paths(output)["ledger"] + ".lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing releases a lock taken
    return False


def _class(record: dict[str, Any]) -> str | None:
    """An entry's error class: a short printable word, or None (an older ledger's entries)."""
    value = record.get("class")
    ok = isinstance(value, str) and 0 < len(value) <= MAX_CLASS_CHARS and value.isprintable()
    return value if ok else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 62


def _tokens(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def read_usage(output: str) -> list[tuple[int, int]] | None:
    """Every call's (prompt, completion) tokens the ledger keeps, read without its lock (only
    whole lines); None without a ledger."""
    path = file_paths(output)["ledger"]
    pairs: list[tuple[int, int]] = []
    seen: set[str] = set()
    try:
        with open(path, "rb") as handle:
            while raw := handle.readline(MAX_LEDGER_LINE + 1):
                record = _record(raw) if raw.endswith(b"\n") else None
                if record is None:
                    break
                if "key" in record and record["key"] not in seen:
                    seen.add(record["key"])
                    # as tuples (JSON gives lists), each a pair or the ValueError of one that is not
                    pairs.extend((p, c) for p, c in record.get("usage") or ())
    except OSError:
        return None
    return pairs


def read_identity(output: str) -> dict[str, Any] | None:
    """The job's identity (its input's path, size and sha256, its settings) from the ledger's
    first line; None without a ledger or one that does not start with it."""
    try:
        with open(file_paths(output)["ledger"], "rb") as handle:
            raw = handle.readline(MAX_LEDGER_LINE + 1)
    except OSError:
        return None
    record = _record(raw) if raw.endswith(b"\n") else None
    identity = record.get("identity") if record and record.get("schema") == SCHEMA else None
    return identity if isinstance(identity, dict) else None
