"""Which SGLang the double stands in for: the `sglang` distribution installed beside it.

On a test host the double shares a virtualenv with the real SGLang wheel (installed --no-deps,
never imported), one virtualenv per SGLang version; whatever version that venv holds is the one
the double reports and whose flags it accepts (README, "Versions").
"""

from __future__ import annotations

from importlib import metadata

from gpusim import SGLANG_VERSION


def installed_sglang_version() -> str:
    """`importlib.metadata.version("sglang")` of this interpreter's environment.

    gpusim.SGLANG_VERSION only when no `sglang` distribution is installed at all (a development
    venv, the double's own tests).
    """
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return SGLANG_VERSION


def public_version(version: str) -> str:
    """PEP 440's public part: "0.5.23+regressed" -> "0.5.23" (the local label dropped)."""
    return version.split("+", 1)[0]
