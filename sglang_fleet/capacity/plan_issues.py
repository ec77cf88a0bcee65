"""A capacity plan's findings: one warning or error as {code, message}, the shape every planner
module reports in (the pre-flight, the verdict and the fleet summary read them).
"""

from __future__ import annotations


def issue(code: str, message: str) -> dict[str, str]:
    """A plan's warning or error: its code and its message."""
    return {"code": code, "message": message}
