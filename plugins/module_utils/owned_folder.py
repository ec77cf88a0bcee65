"""Every delete, rename and write the project makes inside a folder it owns, never leaving it
(docs/STAGING.md, "Files on the host"). Runs on the GPU host: standard library only.

A folder is opened once and every operation below it is relative to that open descriptor. The
folder itself is the operator's (its own path may go through links: /models -> /nvme/models);
nothing below it is followed: each folder on the way is opened with O_NOFOLLOW (open_folder
included), so a symbolic link anywhere inside, to a folder or a file, is never followed out of
it. What the operations act on:

- read and hash: regular files only (plugins/module_utils/bounded_file.py's open_regular: no
symlink,
  no FIFO, no device), each read bounded by what the caller expects;
- remove_file: a regular file only;
- remove_entry: one entry of the folder itself: a folder with its whole tree (shutil.rmtree's
  descriptor-based walk, which unlinks links and never follows them), or a file or link (a link
  is unlinked, its target untouched);
- write_file: a new file written beside the old one and renamed over it (a link there is
  replaced, never written through);
- rename: one entry of the folder to another name in it (a folder stays a folder: a link is
  refused).

    with OwnedFolder("/models/llama/rev-a.partial") as folder:
        folder.remove_file("sub/model-00002.safetensors")   # OutsideFolder if sub is a link
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from typing import Any

from ansible_collections.sglang_fleet.fleet.plugins.module_utils.bounded_file import open_regular

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Folders below the owned one that a walk goes through at most (a checkpoint has two or three).
MAX_PARTS = 32


class OutsideFolder(ValueError):
    """An operation that would leave the folder, or act on something that is not ours to."""


def _parts(relative: str, root: str) -> list[str]:
    """The components of a relative path inside root; OutsideFolder for anything else."""
    parts = relative.split("/") if isinstance(relative, str) else []
    if (
        not parts
        or len(parts) > MAX_PARTS
        or "\0" in relative
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise OutsideFolder(f"{relative!r} is not a path inside {root}")
    return parts


class OwnedFolder:
    """One folder we own, open; see the module docstring."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        """Open the folder at path (following links in path itself); fd: one already open."""
        self.path = path.rstrip("/") or "/"
        if fd is not None:
            self.fd = fd
            return
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise OutsideFolder(f"{self.path} is not a folder") from None

    def open_folder(self, name: str) -> OwnedFolder | None:
        """The folder entry name of this folder, open (None when missing); OutsideFolder when
        it is a link or not a folder."""
        self._child(name)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise OutsideFolder(
                    f"{self.path}/{name} is a symbolic link or not a folder: not followed"
                ) from None
            raise
        return OwnedFolder(f"{self.path}/{name}", fd)

    def names(self) -> list[str]:
        """The entries of this folder, sorted."""
        return sorted(os.listdir(self.fd))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OwnedFolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # walking ---------------------------------------------------------------------------
    def _parent(self, relative: str) -> tuple[int, str]:
        """(descriptor of the folder holding the last component, that component). The caller
        closes the descriptor unless it is self.fd."""
        parts = _parts(relative, self.path)
        fd = self.fd
        try:
            for index, part in enumerate(parts[:-1]):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as err:
                    if err.errno in (errno.ELOOP, errno.ENOTDIR):
                        where = "/".join(parts[: index + 1])
                        raise OutsideFolder(
                            f"{relative}: {where} is a symbolic link or not a folder inside "
                            f"{self.path}: not followed"
                        ) from None
                    raise
                if fd != self.fd:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd != self.fd:
                os.close(fd)
            raise
        return fd, parts[-1]

    def _done(self, fd: int) -> None:
        if fd != self.fd:
            os.close(fd)

    def lstat(self, relative: str) -> os.stat_result | None:
        """The entry's own status (a link's, not its target's); None when it is missing, or
        when a folder on the way is missing."""
        try:
            fd, leaf = self._parent(relative)
        except FileNotFoundError:
            return None
        try:
            return os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            self._done(fd)

    def regular_size(self, relative: str) -> int | None:
        """The size of a regular file here; None when missing or not a regular file."""
        try:
            info = self.lstat(relative)
        except OutsideFolder:
            return None
        return info.st_size if info is not None and stat.S_ISREG(info.st_mode) else None

    # reading ---------------------------------------------------------------------------
    def open_regular(self, relative: str) -> int | None:
        """A read-only descriptor of a regular file here (the caller closes it); None when
        missing; ValueError (OutsideFolder for a link on the way) for anything else."""
        try:
            fd, leaf = self._parent(relative)
        except FileNotFoundError:
            return None
        try:
            return open_regular(leaf, fd)
        except ValueError as err:
            raise ValueError(f"{relative}: {err}") from None
        finally:
            self._done(fd)

    def read_chunks(self, relative: str, limit: int, chunk: int = 8 << 20) -> Iterator[bytes]:
        """The bytes of a regular file here, chunk by chunk, at most limit + 1 of them (a
        caller that gets more than it expected knows the file is not what it should be).
        FileNotFoundError when it is missing."""
        fd = self.open_regular(relative)
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "missing", relative)
        with os.fdopen(fd, "rb") as handle:
            left = limit + 1
            while left > 0:
                data = handle.read(min(chunk, left))
                if not data:
                    return
                left -= len(data)
                yield data

    def read_small(self, relative: str, limit: int) -> bytes | None:
        """A small regular file's bytes (None when missing); ValueError when over limit."""
        try:
            data = b"".join(self.read_chunks(relative, limit))
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise ValueError(f"{self.path}/{relative} is over {limit} bytes")
        return data

    # changing --------------------------------------------------------------------------
    def remove_file(self, relative: str) -> bool:
        """Remove a regular file here (False when it is missing). OutsideFolder for a link,
        a folder, a FIFO or a device: only a file of ours is removed."""
        try:
            fd, leaf = self._parent(relative)
        except FileNotFoundError:
            return False
        try:
            try:
                info = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if not stat.S_ISREG(info.st_mode):
                raise OutsideFolder(f"{self.path}/{relative} is not a regular file: left alone")
            os.unlink(leaf, dir_fd=fd)
            return True
        finally:
            self._done(fd)

    def _child(self, name: str) -> os.stat_result | None:
        _parts(name, self.path)
        if "/" in name:
            raise OutsideFolder(f"{name!r} is not an entry of {self.path}")
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def remove_entry(self, name: str) -> bool:
        """Remove one entry of this folder: a folder with everything in it (links inside are
        unlinked, never followed), or a file or link. False when it is missing."""
        info = self._child(name)
        if info is None:
            return False
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=self.fd)
            return True
        # shutil.rmtree walks by descriptors and never follows a link (rmtree.avoids_symlink_
        # attacks); given a path it checks that the top is the folder it opened. The path is
        # this folder's real one, checked to be the folder we hold open.
        real = os.path.realpath(self.path)
        if not os.path.samestat(os.stat(real), os.fstat(self.fd)):
            raise OutsideFolder(f"{self.path} changed while it was open: nothing removed")
        target = os.path.join(real, name)
        if not os.path.samestat(os.lstat(target), info):
            raise OutsideFolder(f"{target} changed while it was looked at: nothing removed")
        shutil.rmtree(target)
        return True

    def make_folder(self, name: str, mode: int = 0o755) -> bool:
        """A folder entry here (True when made); OutsideFolder when something else is there."""
        info = self._child(name)
        if info is not None:
            if stat.S_ISDIR(info.st_mode):
                return False
            raise OutsideFolder(
                f"{self.path}/{name} exists and is not a folder (a file or a link): "
                "remove it by hand"
            )
        os.mkdir(name, mode, dir_fd=self.fd)
        return True

    def write_file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """name holds data afterwards: written to a new file beside it, flushed to disk and
        renamed over it (whatever was there, a link included, is replaced, not written to)."""
        self._child(name)
        temp = f".{name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
            dir_fd=self.fd,
        )  # fmt: skip
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fchmod(handle.fileno(), mode)
                os.fsync(handle.fileno())
            os.replace(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            os.unlink(temp, dir_fd=self.fd)
            raise
        os.fsync(self.fd)

    def rename(self, name: str, new_name: str) -> None:
        """Rename the folder entry name to new_name, which must not exist (one rename(2))."""
        info = self._child(name)
        if info is None or not stat.S_ISDIR(info.st_mode):
            raise OutsideFolder(f"{self.path}/{name} is not a folder: not renamed")
        if self._child(new_name) is not None:
            raise OutsideFolder(f"{self.path}/{new_name} exists: {name} not renamed onto it")
        os.rename(name, new_name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        os.fsync(self.fd)


def open_log(path: str) -> int:
    """A descriptor that appends to the regular file at path (made when missing, 0644); never
    through a link at its last component, never a FIFO or a device."""
    fd = os.open(
        path,
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        0o644,
    )
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OutsideFolder(f"{path} is not a regular file")
    return fd
