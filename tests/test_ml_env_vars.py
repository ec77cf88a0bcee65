"""The ml_env role's choice of interpreter per distribution, and its Requires-Python check.

Molecule runs Debian 12 only, so the Ubuntu choice is checked here by rendering the role's
vars files as its preflight picks them (first_found: <Distribution>-<major>.yml, default.yml),
and the Requires-Python default is held to the pinned SGLang wheel's own METADATA.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ROLE = ROOT / "roles" / "ml_env"
WHEELHOUSE = ROOT / ".cache" / "wheelhouse"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def picked_vars(distro_key: str) -> dict[str, Any]:
    """What first_found picks for a host, as tasks/preflight.yml asks for it."""
    specific = ROLE / "vars" / f"{distro_key}.yml"
    return load(specific if specific.is_file() else ROLE / "vars" / "default.yml")


def render(template: str, context: dict[str, Any]) -> Any:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return env.from_string(template).render(**context)


@pytest.mark.parametrize(
    ("distro_key", "python"),
    [("Debian-12", "python3"), ("Ubuntu-24", "python3"), ("Ubuntu-22", "python3.11")],
)
def test_each_supported_distribution_gets_a_new_enough_interpreter(distro_key, python):
    assert distro_key in load(ROLE / "vars" / "main.yml")["_ml_env_supported"]
    assert picked_vars(distro_key)["_ml_env_distro_python"] == python


@pytest.mark.parametrize(
    ("setting", "distro_key", "packages"),
    [
        ("", "Ubuntu-22", "['python3.11', 'python3.11-venv']"),
        ("", "Debian-12", "['python3', 'python3-venv']"),
        ("python3.12", "Ubuntu-22", "['python3.12', 'python3.12-venv']"),
        ("/opt/python/bin/python3", "Debian-12", "[]"),
    ],
)
def test_os_packages_follow_the_interpreter(setting, distro_key, packages):
    role_vars = load(ROLE / "vars" / "main.yml")
    context = {"ml_env_python": setting, **picked_vars(distro_key)}
    context["_ml_env_python"] = render(role_vars["_ml_env_python"], context)
    assert render(role_vars["_ml_env_os_packages"], context) == packages


def test_only_distributions_that_differ_have_their_own_vars_file():
    files = sorted(p.name for p in (ROLE / "vars").glob("*.yml"))
    assert files == ["Ubuntu-22.yml", "default.yml", "main.yml"]


def _wheel_requires_python(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        for line in archive.read(name).decode().splitlines():
            if line.startswith("Requires-Python:"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"{wheel.name} declares no Requires-Python")


def test_requires_python_default_is_the_pinned_wheels_own():
    defaults = load(ROLE / "defaults" / "main.yml")
    version = defaults["ml_env_sglang_version"]
    wheels = sorted(WHEELHOUSE.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        pytest.skip(f"no sglang {version} wheel in {WHEELHOUSE} (make wheelhouse downloads it)")
    assert defaults["ml_env_sglang_requires_python"] == _wheel_requires_python(wheels[0])
