"""Weight staging's decisions (docs/STAGING.md): the manifest, the disk-space arithmetic, whether
a revision is already staged, what verification found, and what pruning removes.

Standard library only, Python >= 3.10: Ansible ships it beside plugins/modules/model_stage.py as
``ansible_collections.sglang_fleet.fleet.plugins.module_utils.model_stage`` (with the parts it
imports). Every file operation goes through plugins/module_utils/owned_folder.py (nothing below a
folder we own is followed through a link) and every read is bounded (docs/STAGING.md, "Files on the
host").

Layout on a host, for a server whose ``model_path`` is /models/llama/rev-a:
- /models/llama/rev-a.partial/   the copy in progress (rsync or snapshot_download write here; a
  file is never visible under the final directory's name before the whole revision verified);
- /models/llama/rev-a/           the verified revision, renamed from .partial in one rename(2);
- /models/llama/rev-a/.model-stage.json  our marker: which source and revision, the manifest's
  digest, the file count and bytes. Only a directory with this marker is ours to skip or prune.

The manifest is SGLang's own (``python -m sglang.srt.utils.model_file_verifier generate``):
``{"files": {"<name>": {"sha256": "<64 hex>", "size": <bytes>}}}``.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_json import (
    loads as bounded_loads,
)
from ansible_collections.sglang_fleet.fleet.plugins.module_utils.owned_folder import (
    OutsideFolder,
    OwnedFolder,
)

MARKER = ".model-stage.json"
PARTIAL_SUFFIX = ".partial"
SHA256_RE = re.compile(r"[0-9a-f]{64}")
CHUNK = 8 * 1024 * 1024
GIB = 1024**3
# A manifest or a marker names every file of a checkpoint: thousands of lines, not megabytes.
MAX_LIST_BYTES = 16 * 1024 * 1024
MAX_FILES = 100_000
MAX_FILE_BYTES = 1 << 50  # no single checkpoint file is a pebibyte


class StageError(Exception):
    """A refusal or a failure, in words an operator acts on."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


def _check_name(name: Any, where: str) -> str:
    """A manifest entry names a file inside the checkpoint: relative, no '..', no dot-file."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise StageError(f"{where}: {name!r} is not a file name")
    path = PurePosixPath(name)
    if path.is_absolute() or any(part in ("", ".", "..") for part in name.split("/")):
        raise StageError(f"{where}: {name!r} must be a relative path inside the checkpoint")
    if any(part.startswith(".") for part in path.parts):
        raise StageError(f"{where}: {name!r}: hidden files are not part of a checkpoint")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise StageError(f"{where}: {name!r}: control characters are not part of a file name")
    return name


def parse_manifest(data: Any, where: str = "manifest") -> dict[str, FileEntry]:
    """SGLang's model_file_verifier manifest as {name: FileEntry}; refuses what it cannot check
    (the deprecated 'checksums' form has no sizes, so the disk-space pre-flight could not run)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("files"), Mapping):
        raise StageError(f'{where}: expected {{"files": {{name: {{"sha256", "size"}}}}}}')
    files = data["files"]
    if not files:
        raise StageError(f"{where}: lists no files")
    if len(files) > MAX_FILES:
        raise StageError(f"{where}: lists {len(files)} files, more than {MAX_FILES}")
    entries: dict[str, FileEntry] = {}
    for raw_name, info in files.items():
        name = _check_name(raw_name, where)
        if not isinstance(info, Mapping):
            raise StageError(f"{where}: {name}: expected {{sha256, size}}")
        digest, size = info.get("sha256"), info.get("size")
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            raise StageError(f"{where}: {name}: sha256 must be 64 lowercase hex digits")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
            raise StageError(f"{where}: {name}: size must be a whole number of bytes >= 0")
        entries[name] = FileEntry(digest, size)
    return entries


def read_manifest(folder: OwnedFolder, name: str) -> tuple[dict[str, FileEntry], str]:
    """The manifest file `name` of a partial copy: (its entries, the sha256 of its bytes)."""
    try:
        raw = folder.read_small(name, MAX_LIST_BYTES)
        if raw is None:
            raise StageError(f"the manifest {name} is missing from {folder.path}")
        data = bounded_loads(raw, f"the manifest {name}")
    except (OSError, ValueError) as exc:
        raise StageError(f"the manifest {name} cannot be read: {exc}") from None
    return parse_manifest(data, f"manifest {name}"), manifest_digest(raw)


def manifest_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def total_bytes(manifest: Mapping[str, FileEntry]) -> int:
    return sum(entry.size for entry in manifest.values())


def present_bytes(folder: OwnedFolder, manifest: Mapping[str, FileEntry]) -> int:
    """Bytes of the checkpoint already in a partial copy (a resumed copy needs only the rest);
    a regular file counts at most its expected size, anything else nothing."""
    found = 0
    for name, entry in manifest.items():
        size = folder.regular_size(name)
        found += min(size or 0, entry.size)
    return found


def free_bytes(path: str, statvfs: Callable[[str], Any] = os.statvfs) -> int:
    """Free bytes for an unprivileged writer on the filesystem that will hold path (its nearest
    existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    stats = statvfs(probe)
    return int(stats.f_bavail) * int(stats.f_frsize)


def gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def space_refusal(needed: int, present: int, free: int, margin: int, path: str) -> str | None:
    """The disk-space pre-flight: what is left to copy plus the margin must fit in what is free.
    None when it fits; else the refusal with every number."""
    missing = max(needed - present, 0)
    if free - missing >= margin:
        return None
    return (
        f"not enough disk space for {path}: the checkpoint is {gib(needed)} ({needed} bytes), "
        f"{gib(present)} already copied, {gib(missing)} to copy; {gib(free)} free, and "
        f"{gib(margin)} must stay free (model_stage_free_margin_gb): short by "
        f"{gib(missing + margin - free)}. Nothing was copied."
    )


@dataclass(frozen=True)
class Problem:
    """One file that failed verification. `removable`: a regular file of the partial copy whose
    bytes are wrong (removed so the next run fetches it again); anything else (a link, a
    folder, a device) is left where it is and named."""

    name: str
    text: str
    removable: bool = False

    def __str__(self) -> str:
        return f"{self.name}: {self.text}"


_KINDS = {
    stat.S_IFLNK: "a symbolic link, not a file (a staged checkpoint holds regular files only)",
    stat.S_IFDIR: "a folder, not a file",
}


def sha256_of(folder: OwnedFolder, name: str, size: int) -> tuple[str, int]:
    """(sha256, bytes read) of a regular file here, reading at most size + 1 bytes."""
    digest = hashlib.sha256()
    read = 0
    for chunk in folder.read_chunks(name, size, CHUNK):
        digest.update(chunk)
        read += len(chunk)
    return digest.hexdigest(), read


def _check_one(
    folder: OwnedFolder, name: str, entry: FileEntry, hash_files: bool
) -> Problem | None:
    try:
        info = folder.lstat(name)
        if info is None:
            return Problem(name, f"missing (expected {entry.size} bytes)")
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file (a FIFO, a device)")
            return Problem(name, kind)
        if info.st_size != entry.size:
            return Problem(name, f"size {info.st_size} bytes, the manifest says {entry.size}", True)
        return _hash_problem(folder, name, entry) if hash_files else None
    except OutsideFolder:
        return Problem(name, "a folder on its way is a symbolic link or a file: not followed")
    except (OSError, ValueError) as exc:
        return Problem(name, f"cannot be read ({exc})")


def _hash_problem(folder: OwnedFolder, name: str, entry: FileEntry) -> Problem | None:
    actual, read = sha256_of(folder, name, entry.size)
    if read != entry.size:
        return Problem(name, f"changed size while it was read ({read} bytes)", True)
    if actual != entry.sha256:
        text = f"sha256 {actual[:16]}..., the manifest says {entry.sha256[:16]}..."
        return Problem(name, text, True)
    return None


def verify(
    folder: OwnedFolder,
    manifest: Mapping[str, FileEntry],
    hash_files: bool = True,
    workers: int = 4,
) -> list[Problem]:
    """Every problem found, one per file (empty: the copy is the manifest's checkpoint)."""
    items = sorted(manifest.items())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        found = pool.map(lambda item: _check_one(folder, item[0], item[1], hash_files), items)
        return [problem for problem in found if problem]


def remove_failed(folder: OwnedFolder, problems: Iterable[Problem]) -> list[str]:
    """Remove the removable files of verify()'s problems from a partial copy (so the next run
    fetches them again: rsync's quick check would otherwise keep a same-size corrupt file);
    the names of those that could not be removed."""
    kept = []
    for problem in problems:
        if not problem.removable:
            continue
        try:
            folder.remove_file(problem.name)
        except (OutsideFolder, OSError):
            kept.append(problem.name)
    return kept


def marker_for(source: str, revision: str, digest: str, manifest: Mapping[str, FileEntry]) -> dict:
    return {
        "source": source,
        "revision": revision,
        "manifest_sha256": digest,
        "files": len(manifest),
        "bytes": total_bytes(manifest),
        "sizes": {name: entry.size for name, entry in sorted(manifest.items())},
    }


def read_marker(folder: OwnedFolder) -> dict[str, Any] | None:
    """Our marker in a folder (a regular file, bounded), or None when there is none or it is
    not one of ours (not JSON, too big, a link)."""
    try:
        raw = folder.read_small(MARKER, MAX_LIST_BYTES)
        data = bounded_loads(raw, MARKER) if raw is not None else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def marker_sizes(marker: Mapping[str, Any]) -> dict[str, int]:
    """The marker's {file: size}, only names a checkpoint may have and sizes that are sizes."""
    sizes = marker.get("sizes")
    out: dict[str, int] = {}
    for name, size in sizes.items() if isinstance(sizes, Mapping) else []:
        try:
            _check_name(name, MARKER)
        except StageError:
            continue
        if isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_FILE_BYTES:
            out[name] = size
    return out


def staged_state(parent: OwnedFolder, name: str, source: str, revision: str) -> str:
    """'absent', 'staged' (ours, same source and revision, every file of its marker a regular
    file at its size: a verified revision is never copied or hashed again), 'other' (ours,
    another revision or source), 'broken' (ours, a file lost or resized since), or 'foreign' (a
    link, a file, or a folder without our marker: never overwritten)."""
    info = parent.lstat(name)
    if info is None:
        return "absent"
    folder = parent.open_folder(name) if stat.S_ISDIR(info.st_mode) else None
    if folder is None:
        return "foreign"
    with folder:
        marker = read_marker(folder)
        if marker is None:
            return "foreign"
        if marker.get("source") != source or marker.get("revision") != revision:
            return "other"
        sizes = marker_sizes(marker).items()
        whole = all(folder.regular_size(file_name) == size for file_name, size in sizes)
    return "staged" if whole else "broken"


def prune_candidates(
    parent: OwnedFolder, keep: int, in_use: Callable[[os.stat_result], bool]
) -> list[str]:
    """Names of the folders under parent that pruning removes: only ours (a real folder with
    our marker), oldest first by the time they were staged, beyond the `keep` newest; never one
    in use (in_use(its status): the revision being staged, a path a server's configuration, a
    last-known-good record or a running process refers to, compared by device and inode)."""
    keep = max(keep, 1)
    ours = []
    guarded = 0
    for name in parent.names():
        if name.endswith(PARTIAL_SUFFIX):
            continue
        info = parent.lstat(name)
        if info is None or not stat.S_ISDIR(info.st_mode):
            continue
        folder = parent.open_folder(name)
        if folder is None:
            continue
        with folder:
            marker = read_marker(folder)
        if marker is None:
            continue
        if in_use(info):
            guarded += 1
            continue
        staged_at = marker.get("staged_at")
        finite = isinstance(staged_at, (int, float)) and math.isfinite(staged_at)
        when = float(staged_at) if finite else 0.0
        ours.append((when, name))
    newest_first = [name for _when, name in sorted(ours, reverse=True)]
    room = max(keep - guarded, 0)
    return sorted(newest_first[room:])


def warm_page_cache(folder: OwnedFolder, sizes: Mapping[str, int]) -> int:
    """Read every file once so the load after the restart reads memory, not disk. Bytes read
    (each file at most its recorded size)."""
    read = 0
    for name in sorted(sizes):
        for chunk in folder.read_chunks(name, sizes[name], CHUNK):
            read += len(chunk)
    return read
