"""Files the command-line tools read from a path the operator gives (docs/ARCHITECTURE.md,
"Bounded readers").

A path on the command line may name anything: a FIFO that never ends, a device that never
stops, a log of many GiB. read_text() takes a regular file only
(plugins/module_utils/bounded_file.py's open_regular, following the operator's links: opened without
blocking, so a FIFO is refused rather than waited on) and at most `limit` bytes of it; anything else
is a ValueError whose message names the option, for the tool to print as a usage error.
"""

from __future__ import annotations

import errno
import os

from sglang_fleet.module_utils import bounded_file

# A start-up log with its Decode lines: a week of a busy server is tens of MiB.
LOG_LIMIT = 256 << 20
# JSON the tools wrote themselves (a smoke result, a live sample, a calibration store).
JSON_LIMIT = 64 << 20


class InputFileError(ValueError):
    """A file the tool will not read; `reason` is the message without the option and path."""

    def __init__(self, option: str, path: object, reason: str) -> None:
        super().__init__(f"{option} {path}: {reason}".strip())
        self.reason = reason


def read_text(path: str | os.PathLike[str], limit: int, option: str) -> str:
    """The file's text (undecodable bytes replaced); ValueError naming `option` when it is not
    a regular file, cannot be read or holds more than `limit` bytes."""
    return read_bytes(path, limit, option).decode("utf-8", errors="replace")


def read_bytes(path: str | os.PathLike[str], limit: int, option: str) -> bytes:
    """The file's bytes, on read_text's terms."""
    try:
        fd = bounded_file.open_regular(os.fspath(path), follow_links=True)
    except ValueError:
        raise InputFileError(option, path, "not a regular file") from None
    except OSError as exc:
        raise InputFileError(option, path, f"cannot read it ({exc.strerror})") from None
    if fd is None:
        raise InputFileError(option, path, f"cannot read it ({os.strerror(errno.ENOENT)})")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            raise InputFileError(option, path, f"cannot read it ({exc.strerror})") from None
    if len(data) > limit:
        raise InputFileError(option, path, f"more than {limit >> 20} MiB, not a file it reads")
    return data
