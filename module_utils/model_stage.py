"""Weight staging's decisions (docs/STAGING.md): the manifest, the disk-space arithmetic, whether
a revision is already staged, what verification found, and what pruning removes.

Standard library only, Python >= 3.10: Ansible ships it beside library/model_stage.py as
``ansible.module_utils.model_stage``; tests reach it as ``sglang_fleet.module_utils.model_stage``.

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
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

MARKER = ".model-stage.json"
PARTIAL_SUFFIX = ".partial"
SHA256_RE = re.compile(r"[0-9a-f]{64}")
CHUNK = 8 * 1024 * 1024
GIB = 1024**3


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
    return name


def parse_manifest(data: Any, where: str = "manifest") -> dict[str, FileEntry]:
    """SGLang's model_file_verifier manifest as {name: FileEntry}; refuses what it cannot check
    (the deprecated 'checksums' form has no sizes, so the disk-space pre-flight could not run)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("files"), Mapping):
        raise StageError(f'{where}: expected {{"files": {{name: {{"sha256", "size"}}}}}}')
    files = data["files"]
    if not files:
        raise StageError(f"{where}: lists no files")
    entries: dict[str, FileEntry] = {}
    for raw_name, info in files.items():
        name = _check_name(raw_name, where)
        if not isinstance(info, Mapping):
            raise StageError(f"{where}: {name}: expected {{sha256, size}}")
        digest, size = info.get("sha256"), info.get("size")
        if not isinstance(digest, str) or not SHA256_RE.fullmatch(digest):
            raise StageError(f"{where}: {name}: sha256 must be 64 lowercase hex digits")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise StageError(f"{where}: {name}: size must be a whole number of bytes >= 0")
        entries[name] = FileEntry(digest, size)
    return entries


def manifest_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def total_bytes(manifest: Mapping[str, FileEntry]) -> int:
    return sum(entry.size for entry in manifest.values())


def present_bytes(directory: str, manifest: Mapping[str, FileEntry]) -> int:
    """Bytes of the checkpoint already in a partial copy (a resumed copy needs only the rest);
    a file counts at most its expected size."""
    found = 0
    for name, entry in manifest.items():
        try:
            found += min(os.stat(os.path.join(directory, name)).st_size, entry.size)
        except OSError:
            continue
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


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_one(directory: str, name: str, entry: FileEntry, hash_files: bool) -> str | None:
    path = os.path.join(directory, name)
    try:
        size = os.stat(path).st_size
    except OSError:
        return f"{name}: missing (expected {entry.size} bytes)"
    if size != entry.size:
        return f"{name}: size {size} bytes, the manifest says {entry.size}"
    if hash_files:
        actual = sha256_file(path)
        if actual != entry.sha256:
            return f"{name}: sha256 {actual[:16]}..., the manifest says {entry.sha256[:16]}..."
    return None


def verify(
    directory: str,
    manifest: Mapping[str, FileEntry],
    hash_files: bool = True,
    workers: int = 4,
) -> list[str]:
    """Every problem found, one line per file (empty: the copy is the manifest's checkpoint)."""
    items = sorted(manifest.items())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        found = pool.map(lambda item: _check_one(directory, item[0], item[1], hash_files), items)
        return [problem for problem in found if problem]


def bad_files(problems: Iterable[str]) -> list[str]:
    """The file names of verify()'s lines (removed from a partial copy so the next run fetches
    them again: rsync's quick check would otherwise keep a same-size corrupt file)."""
    return [line.split(": ", 1)[0] for line in problems]


def marker_for(source: str, revision: str, digest: str, manifest: Mapping[str, FileEntry]) -> dict:
    return {
        "source": source,
        "revision": revision,
        "manifest_sha256": digest,
        "files": len(manifest),
        "bytes": total_bytes(manifest),
        "sizes": {name: entry.size for name, entry in sorted(manifest.items())},
    }


def read_marker(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def staged_state(directory: str, source: str, revision: str) -> str:
    """'absent', 'staged' (ours, same source and revision, every file of its manifest at its
    size: a verified revision is never copied or hashed again), 'other' (ours, another
    revision or source), 'broken' (ours, a file lost or resized since), or 'foreign' (a
    directory without our marker: never overwritten)."""
    if not os.path.lexists(directory):
        return "absent"
    marker = read_marker(directory)
    if marker is None:
        return "foreign"
    if marker.get("source") != source or marker.get("revision") != revision:
        return "other"
    sizes = marker.get("sizes")
    if isinstance(sizes, dict):
        for name, size in sizes.items():
            try:
                if os.stat(os.path.join(directory, name)).st_size != size:
                    return "broken"
            except OSError:
                return "broken"
    return "staged"


def prune_candidates(
    parent: str,
    keep: int,
    protected: Iterable[str],
    listdir: Callable[[str], list[str]] = os.listdir,
) -> list[str]:
    """Directories under parent that pruning removes: only ours (with a marker), oldest first
    by the time they were staged, beyond the `keep` newest; never a protected one (the revision
    being staged, any server's model_path, any path a running process loads)."""
    keep = max(keep, 1)
    guarded = {os.path.realpath(p) for p in protected}
    ours = []
    for name in sorted(listdir(parent)):
        path = os.path.join(parent, name)
        if name.endswith(PARTIAL_SUFFIX) or not os.path.isdir(path) or os.path.islink(path):
            continue
        marker = read_marker(path)
        if marker is None:
            continue
        staged_at = marker.get("staged_at")
        ours.append((staged_at if isinstance(staged_at, (int, float)) else 0.0, path))
    newest_first = [path for _, path in sorted(ours, reverse=True)]
    kept = [p for p in newest_first if os.path.realpath(p) in guarded]
    unguarded = [p for p in newest_first if os.path.realpath(p) not in guarded]
    room = max(keep - len(kept), 0)
    return sorted(unguarded[room:])


def model_paths_in_use(proc: str = "/proc") -> list[str]:
    """The --model-path (or --model-path=...) of every process running now: what a running
    server loads is never pruned, whatever the inventory says."""
    found = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "cmdline"), "rb") as handle:
                argv = handle.read().split(b"\x00")
        except OSError:
            continue
        for index, arg in enumerate(argv):
            if arg == b"--model-path" and index + 1 < len(argv):
                found.append(argv[index + 1].decode(errors="replace"))
            elif arg.startswith(b"--model-path="):
                found.append(arg.split(b"=", 1)[1].decode(errors="replace"))
    return sorted(set(found))


def remove_tree(path: str) -> None:
    shutil.rmtree(path)


def warm_page_cache(directory: str, names: Iterable[str]) -> int:
    """Read every file once so the load after the restart reads memory, not disk. Bytes read."""
    read = 0
    for name in sorted(names):
        with open(os.path.join(directory, name), "rb") as handle:
            while chunk := handle.read(CHUNK):
                read += len(chunk)
    return read
