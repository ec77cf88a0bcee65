"""Reading and writing the small files host-side modules own, with bounds (docs/ARCHITECTURE.md).
Runs on the GPU host: standard library only.

- read_regular: a regular file's bytes, at most `limit`; never through a symlink, never a FIFO
  or a device (opened without blocking, then refused), None when it does not exist;
- write_atomic: a file replaced in one rename, with its mode set before it appears;
- inside: a file name joined to the folder it must stay in, refused when it would leave it.
"""

from __future__ import annotations

import os
import stat
import tempfile


def read_regular(path: str, limit: int) -> bytes | None:
    """The file's bytes; None when missing. ValueError when it is not a regular file (a
    symlink, a FIFO, a device, a folder) or holds more than `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symlink where a file must be
        raise ValueError(f"{path} is not a regular file ({err.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is over {limit} bytes")
    return data


def write_atomic(path: str, data: bytes, mode: int) -> None:
    """path holds data afterwards, replaced in one rename (a reader sees the old or the new)."""
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".sglang-fleet-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def inside(folder: str, name: str) -> str:
    """folder/name for a plain file name; ValueError for one that is empty, has a slash or a
    NUL, or is `.` or `..` (it would leave the folder, or name the folder itself)."""
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"{name!r} is not a file name inside {folder}")
    return os.path.join(folder, name)
