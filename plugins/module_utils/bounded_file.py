"""Reading and writing the small files host-side modules own, with bounds (docs/ARCHITECTURE.md).
Runs on the GPU host: standard library only.

- open_regular: a regular file opened for reading (a descriptor); never through a symlink, never
  a FIFO or a device (opened without blocking, then refused); relative to a folder's descriptor
  when `dir_fd` is given (plugins/module_utils/owned_folder.py walks to it);
- read_regular: a regular file's bytes, at most `limit`, None when it does not exist;
- write_atomic: a file replaced in one rename, with its mode set before it appears;
- inside: a file name joined to the folder it must stay in, refused when it would leave it.
"""

from __future__ import annotations

import os
import stat
import tempfile


def open_regular(path: str, dir_fd: int | None = None, follow_links: bool = False) -> int | None:
    """A read-only descriptor of the regular file at path (the caller closes it); None when
    missing. ValueError when it is not a regular file (a symlink, a FIFO, a device, a folder).
    follow_links: a path an operator names (the control node's command lines): a link to a
    regular file is taken, and an error opening it (permissions) is the OSError itself."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symlink where a file must be
        if follow_links:
            raise
        raise ValueError(f"{path} is not a regular file ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file")
    return fd


def read_regular(path: str, limit: int, dir_fd: int | None = None) -> bytes | None:
    """The file's bytes; None when missing. ValueError when it is not a regular file (a
    symlink, a FIFO, a device, a folder) or holds more than `limit` bytes."""
    fd = open_regular(path, dir_fd)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as handle:
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
