"""What weight staging accepts, checked in one place on both sides (docs/STAGING.md): the
control node checks the inventory with it before any host is touched
(sglang_fleet/servers/model_source.py,
plugins/filter/model_stage.py), and the model_stage module checks its arguments with it again
before it touches anything on the host (plugins/modules/model_stage.py).

Standard library only, and of module_utils only the one reader of numbers (typed_number.py),
under whichever name this file itself was imported: modules import it as
``ansible_collections.sglang_fleet.fleet.plugins.module_utils.model_stage_args``, the
control-node package as
``sglang_fleet.module_utils.model_stage_args`` (docs/ARCHITECTURE.md, "module_utils on the
controller"). Every error is an ArgError naming the variable and what it accepts.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

# Relative: the same file is ansible_collections.sglang_fleet.fleet.plugins.module_utils.* on a
# host (AnsiballZ ships typed_number.py beside it) and sglang_fleet.module_utils.* on the control
# node, and each name must bring its own typed_number (one NumberError class per side).
from .typed_number import NumberError, Range, read

SOURCE_KEYS = ("rsync", "hf_repo", "revision", "manifest")
# [user@]host:/path over SSH (rsync's daemon forms, host::module and rsync://, are refused: no
# SSH, no authentication), or an absolute path (shared storage mounted on the host).
RSYNC_REMOTE_RE = re.compile(r"(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9][A-Za-z0-9.-]*:(/.*)")
HF_REPO_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# A pinned Hugging Face revision is a commit: a branch or tag could move under a rollout.
HF_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MANIFEST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_PATH = 4096

# The numeric settings: (smallest, largest) accepted. The largest are far above any real use
# and keep a typo from reaching rsync or a thread pool.
NUMBER_RANGES = {
    "free_margin_bytes": Range(0, 1 << 60, integer=True),
    "keep": Range(1, 1000, integer=True),
    "bwlimit_kbps": Range(0, 1 << 40, integer=True),
    "verify_workers": Range(1, 64, integer=True),
    "timeout": Range(1, 30 * 86400, integer=True),
    "poll": Range(1, 3600, integer=True),
}
GIB_RANGE = Range(0, 1 << 30)


class ArgError(ValueError):
    """A staging input is wrong; `variable` names what to fix."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable
        self.message = message


def text(value: Any, variable: str) -> str:
    """A non-empty string without control characters."""
    if not isinstance(value, str) or not value:
        raise ArgError(variable, "must be a non-empty string")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ArgError(variable, "holds a control character (a newline, a NUL, ...)")
    if len(value) > MAX_PATH:
        raise ArgError(variable, f"is longer than {MAX_PATH} characters")
    return value


def absolute_path(value: Any, variable: str) -> str:
    """An absolute, normal path (no '.', '..' or '//' parts), without its trailing slash."""
    path = text(value, variable)
    bare = path.rstrip("/") or "/"
    if not path.startswith("/") or posixpath.normpath(bare) != bare or bare.startswith("//"):
        raise ArgError(
            variable, f"{path!r} must be an absolute path without '.', '..' or '//' parts"
        )
    return bare


def model_path(value: Any, variable: str) -> str:
    """A staged model_path: absolute and normal, in a folder of its own revisions (pruning
    works in its parent folder, so the parent may not be '/')."""
    path = absolute_path(value, variable)
    if posixpath.dirname(path) == "/":
        raise ArgError(
            variable,
            f"{path!r}: a staged model_path lives in a folder of its revisions, for example "
            "/models/llama/rev-a (old revisions are pruned from that folder)",
        )
    return path


def rsync_source(value: Any, variable: str) -> str:
    """An absolute path or [user@]host:/absolute/path, naming a folder below '/'."""
    source = text(value, variable)
    remote = RSYNC_REMOTE_RE.fullmatch(source)
    path = remote.group(1) if remote else source
    if (
        source.startswith("-")
        or "::" in source
        or "://" in source
        or not path.startswith("/")
        or "/../" in path + "/"
    ):
        raise ArgError(
            variable,
            f"{source!r} is not an absolute path or [user@]host:/absolute/path (no '..'; "
            "rsync:// and host::module are not SSH)",
        )
    bare = path.rstrip("/")
    if not bare or posixpath.normpath(bare) != bare or bare.startswith("//"):
        raise ArgError(
            variable, f"{source!r}: name the checkpoint's folder (not '/', no '.' or '//' parts)"
        )
    return source[: len(source) - len(path)] + bare


def file_name(value: Any, variable: str) -> str:
    name = text(value, variable)
    if not MANIFEST_RE.fullmatch(name):
        raise ArgError(variable, f"{name!r}: a file name in the checkpoint's folder")
    return name


def source(value: Any, variable: str) -> dict[str, str]:
    """A model_source: exactly one of rsync, hf_repo; a revision; optionally a manifest."""
    if not isinstance(value, Mapping):
        raise ArgError(variable, "must be a mapping: {rsync|hf_repo, revision, manifest?}")
    unknown = sorted(str(k) for k in value if k not in SOURCE_KEYS)
    if unknown:
        allowed = ", ".join(SOURCE_KEYS)
        raise ArgError(f"{variable}.{unknown[0]}", f"unknown key; allowed: {allowed}")
    if bool(value.get("rsync")) == bool(value.get("hf_repo")):
        raise ArgError(variable, "needs one of rsync (a path or host:/path), hf_repo")
    revision = text(value.get("revision"), f"{variable}.revision")
    checked: dict[str, str] = {"revision": revision}
    if value.get("hf_repo"):
        repo = text(value["hf_repo"], f"{variable}.hf_repo")
        if not HF_REPO_RE.fullmatch(repo):
            raise ArgError(f"{variable}.hf_repo", f"{repo!r} is not an org/name repo id")
        if not HF_COMMIT_RE.fullmatch(revision):
            raise ArgError(
                f"{variable}.revision",
                f"{revision!r}: pin a Hugging Face source to a commit (40 hex digits); a branch "
                "or tag can move between two hosts' copies",
            )
        checked["hf_repo"] = repo
    else:
        checked["rsync"] = rsync_source(value["rsync"], f"{variable}.rsync")
        if not REVISION_RE.fullmatch(revision):
            raise ArgError(
                f"{variable}.revision", f"{revision!r}: letters, digits, '.', '_' and '-' only"
            )
    if value.get("manifest") is not None:
        checked["manifest"] = file_name(value["manifest"], f"{variable}.manifest")
    return checked


def number(value: Any, variable: str, key: str) -> int:
    """A whole number in NUMBER_RANGES[key] (a whole float or its text is accepted)."""
    try:
        return int(read(value, variable, NUMBER_RANGES[key]))
    except NumberError as exc:
        raise ArgError(variable, exc.message) from None


def gib(value: Any, variable: str) -> float:
    """A finite number of GiB from 0 to 2**30 (fractions allowed; a number's text too)."""
    try:
        return float(read(value, variable, GIB_RANGE))
    except NumberError as exc:
        raise ArgError(variable, f"{exc.message} (GiB)") from None


def command(value: Any, variable: str) -> str:
    """A command line for rsync -e: no control characters, not an option."""
    line = text(value, variable)
    if line.lstrip().startswith("-"):
        raise ArgError(variable, f"{line!r} must start with a program (for example ssh)")
    return line


def endpoint(value: Any, variable: str) -> str:
    """An http(s) URL without credentials or white space."""
    url = text(value, variable)
    scheme, _sep, rest = url.partition("://")
    host = rest.split("/", 1)[0]
    if scheme not in ("http", "https") or not host or "@" in host or any(c.isspace() for c in url):
        raise ArgError(variable, f"{url!r}: an http:// or https:// URL, no user:password@")
    return url
