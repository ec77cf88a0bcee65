"""pytest fixtures for gpusim; the helpers live in gpusim_helpers (importable by tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpusim_helpers import Server, collect_servers, make_state_dir


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return make_state_dir(tmp_path, monkeypatch)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    yield from collect_servers()
