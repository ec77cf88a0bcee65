"""The zipapp builder's command line at its edges (issue 44: `python -m sglang_fleet.host_zipapp
ENTRY -o FILE`). A hostile entry (a path, a name that is no module, a module without main(),
a source that is a link, a FIFO or no Python, an import beyond the standard library) or output
(a folder, a link, a FIFO, a missing folder) is a usage error naming the argument, exit 2, never
a traceback, a hang or a write outside the file named; sources are read only where their
package keeps them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import sglang_fleet
from sglang_fleet.host_zipapp import ZipappError, build, closure, main

SMOKE = "sglang_fleet.smoke.smoke_client.command_line"


def _run(*argv: str) -> tuple[int, str]:
    """(exit status, stderr) of main(argv) in this process; a traceback fails the test."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(list(argv))
        except SystemExit as done:
            status = int(done.code or 0)
    return status, err.getvalue()


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("sglang_fleet.nope.deeper", "is not a module of plain Python source"),
        ("sglang_fleet..x", "is not a module of sglang_fleet"),
        ("sglang_fleet.", "is not a module of sglang_fleet"),
        ("sglang_fleet.smoke\n", "is not a module of sglang_fleet"),
        ("sglang_fleet/smoke/smoke_client/command_line.py", "is not a module of sglang_fleet"),
        ("../../etc/passwd", "is not a module of sglang_fleet"),
        ("/etc/passwd", "is not a module of sglang_fleet"),
        ("sglang_fleet.smoke.smoke_client.command_line.main", "not a module of plain Python"),
        ("sglang_fleet", "has no main() at its top level"),
        ("sglang_fleet.smoke", "has no main() at its top level"),
        ("sglang_fleet.smoke.smoke_client.streams", "has no main() at its top level"),
        ("sglang_fleet.module_utils.fleet_http", "has no main() at its top level"),
        ("sglang_fleet.smoke.smoke_picture", "imports matplotlib"),
        ("s" * 10_000, "is not a module of sglang_fleet"),
        ("sglang_fleet.\u0431", "is not a module of sglang_fleet"),
    ],
)
def test_a_hostile_entry_is_a_usage_error_naming_it(tmp_path: Path, entry: str, said: str) -> None:
    """Before: a missing parent package or `a..b` ended in ModuleNotFoundError, and a module
    without main() became an archive that failed on the host."""
    out = tmp_path / "x.pyz"
    status, err = _run(entry, "-o", str(out))
    assert status == 2, err
    assert said in err and "Traceback" not in err, err
    assert not out.exists()


@contextlib.contextmanager
def _probe_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder of sglang_fleet's (on its __path__) to put probe modules in."""
    folder = tmp_path / "extra"
    folder.mkdir()
    monkeypatch.setattr(sglang_fleet, "__path__", [*sglang_fleet.__path__, str(folder)])
    importlib.invalidate_caches()
    yield folder
    importlib.invalidate_caches()


MAIN = "def main():\n    return 0\n"


def test_a_source_that_is_a_link_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the link's target, wherever it was, went into the archive."""
    outside = tmp_path / "outside.py"
    outside.write_text(MAIN + "SECRET = 'from outside the package'\n")
    with _probe_folder(tmp_path, monkeypatch) as folder:
        (folder / "link_probe.py").symlink_to(outside)
        with pytest.raises(ZipappError, match=r"link_probe\.py cannot be packed: .*not a regular"):
            build("sglang_fleet.link_probe")


def test_a_source_that_is_not_python_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a SyntaxError (or ValueError for a NUL byte) traceback."""
    with _probe_folder(tmp_path, monkeypatch) as folder:
        (folder / "broken_probe.py").write_text(MAIN + "def (:\n")
        (folder / "nul_probe.py").write_bytes(MAIN.encode() + b"x = 1\0\n")
        for name in ("broken_probe", "nul_probe"):
            with pytest.raises(ZipappError, match=rf"{name}\.py is not Python source"):
                closure(f"sglang_fleet.{name}")


def test_a_source_too_large_to_be_a_module_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _probe_folder(tmp_path, monkeypatch) as folder:
        (folder / "huge_probe.py").write_text(MAIN + "#" * (2 << 20) + "\n")
        with pytest.raises(ZipappError, match=r"huge_probe\.py cannot be packed: .*over"):
            closure("sglang_fleet.huge_probe")


def test_an_import_of_a_missing_module_is_refused_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _probe_folder(tmp_path, monkeypatch) as folder:
        (folder / "missing_probe.py").write_text(
            "from sglang_fleet.nowhere.deeper import thing\n\n" + MAIN
        )
        with pytest.raises(ZipappError, match=r"sglang_fleet\.nowhere\.deeper is not a module"):
            closure("sglang_fleet.missing_probe")


def _kinds(folder: Path) -> dict[str, str]:
    """An output path of every kind -o must refuse, and the files links point at."""
    (folder / "a-folder").mkdir()
    os.mkfifo(folder / "a-fifo")
    target = folder / "target.txt"
    target.write_text("the link's target, untouched\n")
    (folder / "a-link").symlink_to(target)
    (folder / "a-dangling-link").symlink_to(folder / "made-through-the-link")
    return {
        "folder": f"{folder}/a-folder",
        "fifo": f"{folder}/a-fifo",
        "link": f"{folder}/a-link",
        "dangling": f"{folder}/a-dangling-link",
        "missing-folder": f"{folder}/missing/x.pyz",
        "file-as-folder": f"{target}/x.pyz",
        "trailing-slash": f"{folder}/x.pyz/",
    }


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("folder", "exists and is not a regular file"),
        ("fifo", "exists and is not a regular file"),
        ("link", "exists and is not a regular file"),
        ("dangling", "exists and is not a regular file"),
        ("missing-folder", "does not exist"),
        ("file-as-folder", "does not exist"),
        ("trailing-slash", "is not a file name"),
    ],
)
def test_an_output_that_is_not_a_file_to_write_is_refused(
    tmp_path: Path, kind: str, said: str
) -> None:
    """Before: a folder, a missing folder or a file as a folder ended in a traceback; a link was
    written through (its target replaced by the archive, and chmod 0755); a FIFO hung."""
    output = _kinds(tmp_path)[kind]
    # Its own process: on the code before, the FIFO blocks the write for ever.
    argv = [sys.executable, "-m", "sglang_fleet.host_zipapp", SMOKE, "-o", output]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "-o" in done.stderr and said in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "target.txt").read_text() == "the link's target, untouched\n"
    assert not (tmp_path / "made-through-the-link").exists()
    assert (tmp_path / "target.txt").stat().st_mode & 0o777 != 0o755


def test_an_empty_output_is_refused() -> None:
    status, err = _run(SMOKE, "-o", "")
    assert status == 2 and "-o '' is not a file name" in err


def test_an_output_that_cannot_be_written_is_a_usage_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: a folder of /proc instead
        locked = Path("/proc/self")
    status, err = _run(SMOKE, "-o", str(locked / "x.pyz"))
    assert status == 2 and "cannot be written" in err and "Traceback" not in err, err
    assert not any(name.startswith(".sglang-fleet-") for name in os.listdir(tmp_path))


def test_an_existing_archive_is_replaced_in_one_rename(tmp_path: Path) -> None:
    out = tmp_path / "smoke.pyz"
    out.write_bytes(b"old")
    before = out.stat().st_ino
    assert _run(SMOKE, "-o", str(out)) == (0, "")
    assert out.read_bytes() == build(SMOKE) and out.stat().st_mode & 0o777 == 0o755
    assert out.stat().st_ino != before  # a new file renamed over the old, not written into
    assert sorted(os.listdir(tmp_path)) == ["smoke.pyz"]  # no temporary file left
