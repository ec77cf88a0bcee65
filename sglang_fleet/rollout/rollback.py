"""The rollback verb's and the router rejoin's decisions, in Python (plugins/action/
sglang_rollback.py, plugins/action/sglang_router_join.py).

- decide: after a failed step, whether this run may go back to last-known-good: a lock another
  run took over leaves the server to that run; a router that would not let the server go left
  it untouched (nothing stopped, nothing to go back from); anything else goes back;
- outcome: what the rollback did, in one sentence (the fleet summary and the failure message);
- failure_message: the message a rollout fails the host with;
- rejoin: whether a replica goes back into its router after the rollback (only one that serves
  again: its last-known-good configuration started);
- join_plan: how a replica rejoins its router: one this run took out must go back (a router
  that does not answer fails it); one it did not take out goes back when its router answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GO_BACK = "go back"
LOCK_LOST = "lock lost"
UNTOUCHED = "untouched"

LOCK_LOST_NOTE = "Another run took over the rollout lock: this run leaves the server to it."
UNTOUCHED_NOTE = "Nothing was stopped: it still runs its old configuration."
NO_LKG_NOTE = (
    "No last-known-good configuration exists yet: the server is stopped and its GPUs are clean."
)


TRUE_WORDS = frozenset(("true", "yes", "on", "1"))
FALSE_WORDS = frozenset(("false", "no", "off", "0", ""))


def flag(value: Any, name: str = "value") -> bool:
    """A result's boolean as Ansible may hand it over (a bool, absent, or its text after
    templating). Anything else is refused by name, never guessed: each of these flags decides
    whether a server is stopped or a replica rejoins its router."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and len(value) <= 8:
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    raise ValueError(f"{name} must be true or false, got {type(value).__name__} {value!r:.40}")


def decide(failure: Mapping[str, Any] | None) -> str:
    """GO_BACK, LOCK_LOST or UNTOUCHED from the failed step's result (its lock_lost and
    untouched); no failure given (an entry point that rolls back on purpose) goes back."""
    failure = failure or {}
    if flag(failure.get("lock_lost"), "failure.lock_lost"):
        return LOCK_LOST
    if flag(failure.get("untouched"), "failure.untouched"):
        return UNTOUCHED
    return GO_BACK


def outcome(decision: str, found: bool, config_hash: str | None) -> str:
    """What happened to the server, as the failure message's last sentence says it."""
    if decision == LOCK_LOST:
        return LOCK_LOST_NOTE
    if decision == UNTOUCHED:
        return UNTOUCHED_NOTE
    if found:
        return (
            f"Rolled back to the last-known-good configuration {config_hash}, which serves again."
        )
    return NO_LKG_NOTE


def failure_message(server: str, decision: str, failure: str, said: str) -> str:
    """`<server>: <what failed>: <why> <what the rollback did>`."""
    what = (
        "its router would not let it go"
        if decision == UNTOUCHED
        else "the new configuration failed"
    )
    return f"{server}: {what}: {failure} {said}"


def row_outcome(decision: str, found: bool) -> str:
    """The fleet summary's outcome for a failed server: rolled back only when it serves its
    last-known-good configuration again."""
    return "rolled back" if decision == GO_BACK and found else "failed"


def rejoin(decision: str, found: bool, has_router: bool) -> bool:
    """A replica goes back into its router only when its last-known-good configuration serves."""
    return has_router and decision == GO_BACK and found


def join_plan(taken_out: bool, router_answers: bool | None) -> str:
    """ "put back" or "leave" for a replica: one this run took out always goes back (its router
    must answer: the put-back fails otherwise); one it did not take out goes back only when its
    router answers (a router that does not answer yet lists it from its own worker list when it
    starts). router_answers is None when it was not asked (a replica this run took out)."""
    if taken_out or router_answers:
        return "put back"
    return "leave"
