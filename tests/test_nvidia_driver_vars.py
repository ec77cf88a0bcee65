"""The nvidia_driver role's per-distribution choices (vars/<Distribution>-<major>.yml).

Molecule runs on Debian 12 only (no Ubuntu test image), so the Ubuntu package selection and
CUDA repository path are checked here: each vars file rendered with Jinja2 as the role's
preflight combines them, for both kernel-module flavours.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

ROLE = Path(__file__).resolve().parent.parent / "roles" / "nvidia_driver"
FACTS = {"architecture": "x86_64", "kernel": "6.8.0-49-generic", "distribution_release": "noble"}


def render(value: Any, context: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return jinja2.Template(value, undefined=jinja2.StrictUndefined).render(**context)
    if isinstance(value, list):
        return [render(v, context) for v in value]
    if isinstance(value, dict):
        return {k: render(v, context) for k, v in value.items()}
    return value


def selection(distro: str, kernel_module: str, fabric_manager: bool) -> tuple[dict, list[str]]:
    """The role's package list for one distribution (preflight.yml's expression, in Python)."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
    context: dict[str, Any] = {**defaults, "ansible_facts": FACTS}
    context["_nvidia_driver_deb_arch"] = "amd64"
    chosen = render(yaml.safe_load((ROLE / "vars" / f"{distro}.yml").read_text()), context)
    packages = (
        chosen["_nvidia_driver_base_packages"]
        + chosen["_nvidia_driver_module_packages"][kernel_module]
        + (chosen["_nvidia_driver_fabric_manager_packages"] if fabric_manager else [])
    )
    return chosen, packages


@pytest.mark.parametrize(
    ("distro", "repo_dir"), [("Ubuntu-22", "ubuntu2204"), ("Ubuntu-24", "ubuntu2404")]
)
def test_ubuntu_uses_the_cuda_repository_and_branch_packages(distro: str, repo_dir: str) -> None:
    chosen, packages = selection(distro, "open", fabric_manager=True)
    assert chosen["_nvidia_driver_repository"] == "cuda"
    assert chosen["_nvidia_driver_cuda_distro"] == repo_dir
    assert chosen["_nvidia_driver_apt_pin"] is False
    assert packages == [
        "linux-headers-6.8.0-49-generic",
        "nvidia-open-580",
        "nvidia-fabricmanager-580",
    ]
    _, proprietary = selection(distro, "proprietary", fabric_manager=False)
    assert proprietary == ["linux-headers-6.8.0-49-generic", "cuda-drivers-580"]


def test_debian_uses_non_free_with_a_pin_and_no_fabric_manager() -> None:
    chosen, packages = selection("Debian-12", "proprietary", fabric_manager=False)
    assert chosen["_nvidia_driver_repository"] == "debian_nonfree"
    assert chosen["_nvidia_driver_apt_pin"] is True
    assert packages[-1] == "nvidia-kernel-dkms"
    assert {"nvidia-driver", "firmware-misc-nonfree", "linux-headers-amd64"} <= set(packages)
    assert chosen["_nvidia_driver_fabric_manager_packages"] == []


def test_every_supported_distribution_has_a_vars_file() -> None:
    main = yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8"))
    for key in main["_nvidia_driver_supported"]:
        assert (ROLE / "vars" / f"{key}.yml").is_file(), key
