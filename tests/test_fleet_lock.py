"""Tests for the rollout lock: plugins/modules/fleet_lock.py (host side, the file) and
plugins/action/fleet_lock.py (controller side, whose run it is and whether that run is alive).

The file logic runs on tmp paths with injected clocks; liveness runs on real processes (a fake
ansible-playbook that forks a worker the way Ansible does, killed with SIGKILL); the whole thing
runs through ansible-playbook against localhost, two runs at once and a killed run whose worker
still works. See docs/LOCKING.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from conftest import load_plugin

ROOT = Path(__file__).resolve().parent.parent


mod = load_plugin("plugins/modules/fleet_lock.py")
act = load_plugin("plugins/action/fleet_lock.py")
wait = load_plugin("plugins/action/sglang_wait_healthy.py")

BOOT = "11111111-2222-3333-4444-555555555555"
OWNER = {
    "user": "alice",
    "uid": 1000,
    "controller": "ctl-1",
    "controller_boot_id": "cccccccc-0000-0000-0000-000000000001",
    "controller_pidns": "pid:[4026531836]",
    "pid": 4242,
    "pid_starttime": 5000,
    "cmdline_sha256": "0" * 64,
    "playbook": "deploy.yml",
}


class Clock:
    """The host's clock, moved by hand: boot time and wall time can disagree (NTP steps)."""

    def __init__(self, boottime: float = 1000.0, wall: float = 1_800_000_000.0) -> None:
        self.boot_id, self.boottime, self.wall = BOOT, boottime, wall

    def __call__(self) -> Any:
        return mod.HostClock(self.boot_id, self.boottime, self.wall)

    def advance(self, seconds: float) -> None:
        self.boottime += seconds
        self.wall += seconds


def take(path: Path, clock: Clock, run_id: str = "run-a", **kw: Any) -> dict[str, Any]:
    check_mode = kw.pop("check_mode", False)
    req = mod.Acquire(str(path), {**OWNER, **kw.pop("owner", {})}, run_id, **kw)
    return mod.acquire(req, check_mode, clock)


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    return tmp_path / "fleet.lock"


# --------------------------------------------------------------------------- module: ages


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (-30, "0 s"),
        (59.4, "59 s"),
        (200, "3 min 20 s"),
        (600, "10 min"),
        (3600, "1 h"),
        (7500, "2 h 5 min"),
        (97200, "1 d 3 h"),
    ],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert mod.human_duration(seconds) == text


def test_free_lock_is_created_whole_and_readable(lock: Path) -> None:
    got = take(lock, Clock(), lease_s=600)
    assert got["outcome"] == "acquired" and got["acquired"] and got["changed"]
    record = json.loads(lock.read_text())
    assert record["token"] == got["token"] and len(got["token"]) == 32
    assert record["owner"] == OWNER and record["lease_s"] == 600 and record["depth"] == 1
    assert record["host_clock"]["boot_id"] == BOOT
    assert oct(lock.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in lock.parent.iterdir()) == ["fleet.lock"]  # no temp file left


def test_another_run_gets_the_holder_with_ages_on_the_hosts_boot_clock(lock: Path) -> None:
    clock = Clock()
    take(lock, clock, lease_s=900)
    clock.advance(200)
    clock.wall -= 86400 * 365  # the wall clock jumped back a year: boot time does not care
    got = take(lock, clock, run_id="run-b", owner={"user": "bob"})
    assert got["outcome"] == "held" and not got["acquired"] and got["token"] == ""
    holder = got["holder"]
    assert (holder["age_s"], holder["renewed_ago_s"], holder["lease_left_s"]) == (200, 200, 700)
    assert holder["clock"] == "boottime" and holder["clock_note"] == ""
    assert holder["summary"] == (
        "alice@ctl-1 (pid 4242, playbook deploy.yml), taken 3 min 20 s ago by the host's "
        "clock, lease ends in 11 min 40 s"
    )
    assert holder["sha256"] == hashlib.sha256(lock.read_bytes()).hexdigest()


def test_after_a_host_reboot_ages_come_from_the_wall_clock_and_say_so(lock: Path) -> None:
    clock = Clock()
    take(lock, clock, lease_s=900)
    clock.boot_id, clock.boottime, clock.wall = "another-boot", 30.0, clock.wall + 1000
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert holder["clock"] == "wall" and "rebooted" in holder["clock_note"]
    assert (holder["age_s"], holder["lease_left_s"]) == (1000, -100)
    assert "lease ended 1 min 40 s ago" in holder["summary"]


def test_a_wall_clock_that_went_back_gives_no_negative_age(lock: Path) -> None:
    """Another boot: never a negative age, and at least this boot's age (1000 s here)."""
    clock = Clock()
    take(lock, clock)
    clock.boot_id, clock.wall = "another-boot", clock.wall - 5000
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert holder["age_s"] == 1000 and "went back" in holder["clock_note"]
    assert "taken 16 min 40 s ago" in holder["summary"]


def test_a_renewal_in_the_future_from_an_earlier_boot_counts_from_this_boots_start(
    lock: Path,
) -> None:
    """Written before this boot began, so at least this boot's age ago, whatever the wall
    clock says: a lock whose renewal lies in the future does not hold on every try."""
    clock = Clock()
    take(lock, clock, lease_s=900)
    clock.boot_id, clock.boottime, clock.wall = "another-boot", 60.0, clock.wall - 5000
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert holder["age_s"] == 60 and holder["lease_left_s"] == 840
    assert "went back" in holder["clock_note"] and "this boot's start" in holder["clock_note"]
    clock.boottime = 901.0
    assert take(lock, clock, run_id="run-b")["holder"]["lease_left_s"] == -1


# --------------------------------------------------------------------------- module: states


def test_same_run_reenters_and_releases_level_by_level(lock: Path) -> None:
    clock = Clock()
    first = take(lock, clock, lease_s=300)
    clock.advance(100)
    again = take(lock, clock, lease_s=600)
    assert again["outcome"] == "reentered" and again["token"] == first["token"]
    assert again["depth"] == 2 and again["lease_s"] == 600 and not again["changed"]
    kept = mod.release(str(lock), first["token"], False, clock)
    assert kept["outcome"] == "kept" and kept["depth"] == 1 and lock.exists()
    done = mod.release(str(lock), first["token"], False, clock)
    assert done["outcome"] == "released" and done["changed"] and not lock.exists()
    assert mod.release(str(lock), first["token"], False, clock)["outcome"] == "absent"


def test_renew_moves_the_lease_and_keeps_the_taken_time(lock: Path) -> None:
    clock = Clock()
    token = take(lock, clock, lease_s=300)["token"]
    clock.advance(250)
    got = mod.renew(str(lock), token, 1200, False, clock)
    assert got["outcome"] == "renewed" and got["lease_s"] == 1200 and not got.get("failed")
    clock.advance(100)
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert (holder["age_s"], holder["renewed_ago_s"], holder["lease_left_s"]) == (350, 100, 1100)
    kept_lease = mod.renew(str(lock), token, None, False, clock)
    assert kept_lease["lease_s"] == 1200


def test_renew_fails_when_the_lock_is_someone_elses_or_gone(lock: Path) -> None:
    clock = Clock()
    take(lock, clock)
    lost = mod.renew(str(lock), "not-our-token", None, False, clock)
    assert lost["failed"] and lost["lock_lost"] and lost["outcome"] == "lost"
    assert "now held by alice@ctl-1 (pid 4242" in lost["msg"]
    lock.unlink()
    gone = mod.renew(str(lock), "not-our-token", None, False, clock)
    assert gone["failed"] and "the file is gone" in gone["msg"]


def test_release_leaves_another_runs_lock_alone(lock: Path) -> None:
    clock = Clock()
    take(lock, clock)
    before = lock.read_bytes()
    got = mod.release(str(lock), "not-our-token", False, clock)
    assert got["outcome"] == "not_ours" and not got["changed"]
    assert "left alone" in got["warnings"][0] and lock.read_bytes() == before
    assert mod.release(str(lock), "", False, clock)["outcome"] == "not_held"


def test_takeover_replaces_only_the_file_judged_stale(lock: Path) -> None:
    clock = Clock()
    old = take(lock, clock, lease_s=60)
    judged = take(lock, clock, run_id="run-b")["holder"]["sha256"]
    clock.advance(30)
    mod.renew(str(lock), old["token"], None, False, clock)  # the holder showed life meanwhile
    raced = take(lock, clock, run_id="run-b", replace_sha256=judged)
    assert raced["outcome"] == "changed" and not raced["acquired"]
    assert json.loads(lock.read_text())["token"] == old["token"]
    fresh = take(lock, clock, run_id="run-b")["holder"]["sha256"]
    won = take(lock, clock, run_id="run-b", replace_sha256=fresh, lease_s=120)
    assert won["outcome"] == "taken_over" and won["acquired"] and won["changed"]
    assert won["holder"]["owner"]["user"] == "alice"
    assert json.loads(lock.read_text())["token"] == won["token"] != old["token"]


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "empty"),
        (b'{"version": 1, "token": "ab', "not JSON: truncated or damaged"),
        (b"\xff\xfe", "not JSON: truncated or damaged"),
        (b"[1, 2]", "not a lock record (JSON list)"),
        (b'{"token": 5}', "not a lock record (missing or bad: token, run_id"),
    ],
)
def test_unreadable_lock_is_held_until_its_file_time_passes_the_lease(
    lock: Path, content: bytes, problem: str
) -> None:
    clock = Clock()
    lock.write_bytes(content)
    os.utime(lock, (clock.wall - 100, clock.wall - 100))
    got = take(lock, clock, run_id="run-b", lease_s=300)
    holder = got["holder"]
    assert got["outcome"] == "held" and not holder["readable"]
    assert holder["problem"].startswith(problem) and holder["size"] == len(content)
    assert (holder["clock"], holder["age_s"], holder["lease_left_s"]) == ("mtime", 100, 200)
    assert f"an unreadable lock file {lock} ({len(content)} bytes, {problem}" in holder["summary"]
    assert str(lock) in got["msg"]
    os.utime(lock, (clock.wall - 400, clock.wall - 400))
    assert take(lock, clock, run_id="run-b", lease_s=300)["holder"]["lease_left_s"] == -100


def test_an_unreadable_lock_with_a_future_time_is_refused_naming_the_file(lock: Path) -> None:
    """Issue 33: its age cannot be measured, so its lease would never end. It is neither
    counted as a normal held lock ("lease ends in 5 min", forever) nor taken over: the acquire
    fails naming the file and what to do (docs/LOCKING.md, "A time in the future")."""
    clock = Clock()
    lock.write_bytes(b"garbage")
    os.utime(lock, (clock.wall + 86400 * 365, clock.wall + 86400 * 365))
    for _ in range(2):  # the same on every try: no lease runs out
        got = take(lock, clock, run_id="run-b", lease_s=300)
        holder = got["holder"]
        assert got["outcome"] == "held" and holder["unmeasurable"] is True
        assert f"a lock file {lock} (7 bytes, not JSON" in holder["summary"]
        assert "cannot be measured" in holder["summary"] and "lease ends" not in holder["summary"]
        assert re.search(r"modification time is 36\d d .*in the future", holder["clock_note"])
        verdict = act.judge(holder, _me(9999), {}, str(lock), "gpu-1")
        assert not verdict.stale and "neither taken over nor waited for" in verdict.reason
        assert f"remove {lock} on gpu-1 by hand" in verdict.advice
        clock.advance(3600)


def test_a_record_renewed_in_the_future_of_this_boot_is_refused_too(lock: Path) -> None:
    clock = Clock()
    take(lock, clock, lease_s=300)
    clock.boottime -= 500  # the same boot cannot go back: the record is not of this clock
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert holder["unmeasurable"] is True and "renewal time is 8 min 20 s" in holder["clock_note"]
    verdict = act.judge(holder, _me(9999, boot="a-different-boot"), {}, str(lock), "gpu-1")
    assert not verdict.stale and "neither taken over nor waited for" in verdict.reason


def test_a_fifo_in_the_locks_place_is_an_error_not_a_hang(lock: Path) -> None:
    os.mkfifo(lock)
    with pytest.raises(mod.LockError, match="is not a regular file"):
        take(lock, Clock())


def test_lock_of_the_older_shell_playbooks_names_its_holder(lock: Path) -> None:
    clock = Clock()
    lock.write_text('{"controller": "ctl-9", "pid": 77, "user": "carol", "started": 1}\n')
    os.utime(lock, (clock.wall - 10, clock.wall - 10))
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert holder["owner"] == {"user": "carol", "controller": "ctl-9", "pid": 77}
    assert holder["summary"].startswith("carol@ctl-9 (pid 77), a lock of an older sglang-fleet")


def test_check_mode_writes_nothing(lock: Path) -> None:
    params = {
        "path": str(lock),
        "state": "acquired",
        "owner": OWNER,
        "run_id": "run-a",
        "token": "",
        "lease_s": None,
        "replace_sha256": None,
    }
    got = mod.run(params, True)
    assert got["outcome"] == "would_acquire" and got["token"] == ""
    assert list(lock.parent.iterdir()) == []  # not even the guard file
    clock = Clock()
    take(lock, clock)
    before = lock.read_bytes()
    stale = take(lock, clock, run_id="run-b")["holder"]["sha256"]
    would = take(lock, clock, run_id="run-b", replace_sha256=stale, check_mode=True)
    assert would["outcome"] == "would_take_over" and lock.read_bytes() == before


def _race(args: tuple[str, str]) -> str:
    path, run_id = args
    params = {
        "path": path,
        "state": "acquired",
        "owner": OWNER,
        "run_id": run_id,
        "token": "",
        "lease_s": 60,
        "replace_sha256": None,
    }
    return mod.run(params, False)["outcome"]


def test_of_many_simultaneous_runs_exactly_one_takes_the_lock(lock: Path) -> None:
    with multiprocessing.get_context("fork").Pool(8) as pool:
        outcomes = pool.map(_race, [(str(lock), f"run-{i}") for i in range(16)])
    assert sorted(outcomes) == ["acquired"] + ["held"] * 15


def test_guard_held_too_long_is_a_clear_error(lock: Path) -> None:
    fd = os.open(f"{lock}.guard", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(mod.LockError, match="stayed locked for 0 s"), mod.guard(str(lock), 0.2):
            pass
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": "relative.lock"}, "path must be an absolute path"),
        ({"path": "/nonexistent-dir/x.lock"}, "directory /nonexistent-dir does not exist"),
        ({"lease_s": 0}, "lease_s must be a whole number of seconds above 0, got 0"),
        ({"owner": None}, "state=acquired needs owner and run_id"),
        ({"state": "renewed"}, "state=renewed needs the token"),
    ],
)
def test_bad_parameters_are_named(lock: Path, change: dict[str, Any], message: str) -> None:
    params = {
        "path": str(lock),
        "state": "acquired",
        "owner": OWNER,
        "run_id": "r",
        "token": "",
        "lease_s": None,
        "replace_sha256": None,
    }
    assert message in mod.bad_params({**params, **change})


def test_documentation_matches_the_argument_spec() -> None:
    doc = yaml.safe_load(mod.DOCUMENTATION)
    assert set(doc["options"]) == set(mod.ARGUMENT_SPEC)
    for name, spec in mod.ARGUMENT_SPEC.items():
        assert doc["options"][name]["type"] == spec["type"], name
        assert doc["options"][name].get("default") == spec.get("default"), name
    assert yaml.safe_load(mod.EXAMPLES) and "outcome" in yaml.safe_load(mod.RETURN)


# --------------------------------------------------------------------------- controller side


def _proc(pid: int, ppid: int, cmd: bytes, start: int, uid: int = 1000) -> Any:
    return act.Proc(pid, ppid, uid, start, cmd)


PLAYBOOK_CMD = b"/venv/bin/python3\0/venv/bin/ansible-playbook\0-e\0api_key=s3cret\0deploy.yml\0"


def test_playbook_process_is_the_top_of_the_same_command_line() -> None:
    procs = {
        1: _proc(1, 0, b"init\0", 1),
        10: _proc(10, 1, b"bash\0", 50),
        20: _proc(20, 10, PLAYBOOK_CMD, 100),
        30: _proc(30, 20, PLAYBOOK_CMD, 120),  # a worker: forked, not exec'd
    }
    assert act.playbook_process(30, procs).pid == 20
    assert act.playbook_process(20, procs).pid == 20


def test_owner_names_playbooks_but_never_the_command_line() -> None:
    controller = act.Controller("ctl-1", "boot", "pid:[1]", 1000, False)
    owner = act.RunIdentity(controller, _proc(20, 10, PLAYBOOK_CMD, 100)).owner()
    assert owner["playbook"] == "deploy.yml" and owner["pid"] == 20
    assert owner["cmdline_sha256"] == hashlib.sha256(PLAYBOOK_CMD).hexdigest()
    assert "s3cret" not in json.dumps(owner)
    assert act.playbook_names(b"/usr/bin/python3\0/usr/bin/ansible-playbook\0") == (
        "ansible-playbook"
    )


@pytest.mark.parametrize(
    ("options", "hidden"),
    [
        ("rw", False),
        ("rw,hidepid=0", False),
        ("rw,hidepid=invisible", True),
        ("rw,hidepid=2", True),
    ],
)
def test_hidepid_is_read_from_mountinfo(options: str, hidden: bool) -> None:
    line = f"22 27 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:13 - proc proc {options}"
    assert act.hidepid_active(f"1 0 0:1 / / rw - ext4 /dev/sda1 rw\n{line}\n") is hidden


def _me(pid: int, uid: int = 1000, boot: str = "cccccccc-0000-0000-0000-000000000001") -> Any:
    controller = act.Controller("ctl-1", boot, OWNER["controller_pidns"], uid, False)
    return act.RunIdentity(controller, _proc(pid, 1, b"other\0", 9000, uid))


def _holder(lease_left: int, **owner: Any) -> dict[str, Any]:
    return {"readable": True, "owner": {**OWNER, **owner}, "lease_left_s": lease_left}


def test_holder_on_another_controller_is_stale_only_when_its_lease_ended() -> None:
    me = _me(9999, boot="a-different-boot")
    live = act.judge(_holder(100), me, {}, "/run/lock/x", "gpu-1")
    assert not live.stale and "only the end of its lease frees the lock" in live.reason
    assert "remove /run/lock/x on gpu-1 by hand" in live.advice
    assert act.judge(_holder(0), me, {}, "/run/lock/x", "gpu-1").stale


def test_unreadable_holder_is_judged_by_its_lease() -> None:
    unreadable = {"readable": False, "owner": {}, "lease_left_s": 5}
    verdict = act.judge(unreadable, _me(9999), {}, "/x", "h")
    assert not verdict.stale and "does not name a run" in verdict.reason
    assert verdict.advice.startswith("It is taken over when its lease ends; if you are sure")
    assert act.judge({**unreadable, "lease_left_s": -1}, _me(9999), {}, "/x", "h").stale


def test_same_controller_without_processes_is_gone_even_with_lease_left() -> None:
    verdict = act.judge(_holder(800), _me(9999), {}, "/x", "h")
    assert verdict.stale and verdict.reason == "no process of that run is left on this controller"


def test_live_run_on_this_controller_keeps_the_lock_after_its_lease() -> None:
    cmd = b"ansible-playbook deploy.yml\0"
    sha = hashlib.sha256(cmd).hexdigest()
    orphan = _proc(4300, 1, cmd, 5100)  # a worker whose ansible-playbook was killed
    verdict = act.judge(_holder(-50, cmdline_sha256=sha), _me(9999), {4300: orphan}, "/x", "h")
    assert not verdict.stale and verdict.pids == (4300,)
    assert "its lease has ended, but the run is still alive" in verdict.reason


def test_liveness_ignores_older_other_users_and_our_own_processes() -> None:
    cmd = b"ansible-playbook deploy.yml\0"
    owner = {"cmdline_sha256": hashlib.sha256(cmd).hexdigest()}
    procs = {
        4100: _proc(4100, 1, cmd, 4900),  # same command, started before that run
        4400: _proc(4400, 1, cmd, 5200, uid=0),  # same command, another user
        9999: _proc(9999, 1, cmd, 9000),  # our own ansible-playbook (same command line)
        10000: _proc(10000, 9999, cmd, 9001),  # and our worker
    }
    me = act.RunIdentity(_me(9999).controller, procs[9999])
    assert act.judge(_holder(100, **owner), me, procs, "/x", "h").stale


def test_without_proc_nothing_is_proven_gone() -> None:
    controller = act.Controller(
        "ctl-1", OWNER["controller_boot_id"], OWNER["controller_pidns"], 1000, False
    )
    me = act.fallback_identity(controller)
    assert act.processes_now(me) == {}
    verdict = act.judge(_holder(100), me, {}, "/x", "h")
    assert not verdict.stale and "only the end of its lease" in verdict.reason


def test_hidden_processes_prove_nothing() -> None:
    controller = act.Controller(
        "ctl-1", OWNER["controller_boot_id"], OWNER["controller_pidns"], 2000, True
    )
    me = act.RunIdentity(controller, _proc(9999, 1, b"x\0", 9000, 2000))
    verdict = act.judge(_holder(100), me, {}, "/x", "h")
    assert not verdict.stale and "hidepid" in verdict.reason


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"state": "taken"}, "state must be one of acquired, renewed, released, got 'taken'"),
        ({"path": "x.lock"}, "path must be an absolute path, got 'x.lock'"),
        ({"lease_s": "abc"}, "lease_s must be a whole number of seconds above 0, got 'abc'"),
        ({"lease_s": -5}, "lease_s must be a whole number of seconds above 0, got -5"),
        ({"token": "abc"}, "token is for state=renewed and state=released only"),
    ],
)
def test_bad_action_arguments_fail_before_the_host(args: dict[str, Any], message: str) -> None:
    with pytest.raises(act.AnsibleActionFail, match=message.replace("(", r"\(")):
        act.check_args(args)


# --------------------------------------------------------------------------- real processes

# A stand-in for ansible-playbook: it forks a worker without exec (same command line), and the
# worker leaves its session as Ansible's workers do, then works until told to stop.
FAKE_PLAYBOOK = """
import os, sys, time
folder = sys.argv[1]
child = os.fork()
if child == 0:
    os.setsid()
    while not os.path.exists(os.path.join(folder, "stop")):
        time.sleep(0.05)
    os._exit(0)
with open(os.path.join(folder, "worker.tmp"), "w") as out:
    out.write(str(child))
os.rename(os.path.join(folder, "worker.tmp"), os.path.join(folder, "worker"))
while True:
    time.sleep(1)
"""


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_playbooks_worker_keeps_its_run_alive(tmp_path: Path) -> None:
    playbook = subprocess.Popen([sys.executable, "-c", FAKE_PLAYBOOK, str(tmp_path)])
    try:
        _wait_for((tmp_path / "worker").exists)
        worker = int((tmp_path / "worker").read_text())
        controller = act.read_controller()
        procs = act.list_procs()
        assert act.playbook_process(worker, procs).pid == playbook.pid
        holder = {
            "readable": True,
            "lease_left_s": -1,
            "owner": act.RunIdentity(controller, procs[playbook.pid]).owner(),
        }
        me = act.identify(procs, controller, os.getpid())

        def verdict() -> Any:
            return act.judge(holder, me, act.list_procs(), "/x", "h")

        assert verdict().pids == (playbook.pid,)
        playbook.send_signal(signal.SIGKILL)
        playbook.wait(timeout=10)
        alive = verdict()
        assert not alive.stale and alive.pids == (worker,)
        (tmp_path / "stop").touch()
        _wait_for(lambda: act.read_proc(worker) is None)
        gone = verdict()
        assert gone.stale and gone.pids == ()
    finally:
        (tmp_path / "stop").touch()
        playbook.kill()
        playbook.wait(timeout=10)


def test_our_own_workers_never_keep_an_older_run_alive(tmp_path: Path) -> None:
    """Run the same playbook again after a crash: our workers share the dead run's command line."""
    playbook = subprocess.Popen([sys.executable, "-c", FAKE_PLAYBOOK, str(tmp_path)])
    try:
        _wait_for((tmp_path / "worker").exists)
        procs = act.list_procs()
        me = act.RunIdentity(act.read_controller(), procs[playbook.pid])
        dead_run = {**me.owner(), "pid": 4_999_999, "pid_starttime": me.playbook.starttime - 1}
        holder = {"readable": True, "lease_left_s": 500, "owner": dead_run}
        assert act.judge(holder, me, procs, "/x", "h").stale
    finally:
        (tmp_path / "stop").touch()
        playbook.kill()
        playbook.wait(timeout=10)


# --------------------------------------------------------------------------- health-wait renewal


class FakeWait(wait.ActionModule):
    """sglang_wait_healthy with the host replaced: the probe answers from a script, fleet_lock
    is the real module's renew() on a tmp file."""

    def __init__(self, args: dict[str, Any], probes: list[str], lock: Path, clock: Clock):
        self._task = SimpleNamespace(args=args)
        self._play_context = SimpleNamespace(check_mode=False)
        self.probes, self.lock, self.clock, self.calls = probes, lock, clock, []

    def _execute_module(self, module_name: str, module_args: dict, task_vars: Any = None) -> dict:
        # The collection's modules by FQCN (sglang_fleet/collection.py): a short name resolves only
        # in a checkout.
        assert module_name.startswith("sglang_fleet.fleet."), module_name
        module_name = module_name.removeprefix("sglang_fleet.fleet.")
        self.calls.append(module_name)
        if module_name == "fleet_lock":
            assert module_args["path"] == str(self.lock) and module_args["state"] == "renewed"
            return mod.renew(
                module_args["path"],
                module_args["token"],
                module_args.get("lease_s"),
                False,
                self.clock,
            )
        self.clock.advance(10)
        state = self.probes.pop(0)
        return {"state": state, "last_log_line": "loading", "active_state": "active/running"}


@pytest.fixture
def no_base_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wait.ActionBase, "run", lambda self, tmp=None, task_vars=None: {})


PROBE_ARGS = {
    "unit": "sglang@kimi.service",
    "url": "http://127.0.0.1:8000/health_generate",
    "since": 0,
    "poll_interval": 0,
    "timeout": 600,
}


@pytest.mark.usefixtures("no_base_run")
def test_health_wait_renews_the_lock_while_it_polls(
    lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()  # each probe takes 10 s of it; renewals are due every 5 s
    monkeypatch.setattr(wait.LeaseRenewal, "clock", staticmethod(lambda: clock.boottime))
    token = take(lock, clock, lease_s=60)["token"]
    args = {
        **PROBE_ARGS,
        "lock_path": str(lock),
        "lock_token": token,
        "lock_lease_s": 900,
        "lock_renew_interval": 5,
    }
    action = FakeWait(args, ["starting", "starting", "healthy"], lock, clock)
    got = action.run(task_vars={"inventory_hostname": "gpu-1"})
    assert got["state"] == "healthy" and not got.get("failed")
    assert action.calls == ["fleet_lock", "sglang_health_probe"] * 3
    holder = take(lock, clock, run_id="run-b")["holder"]
    assert holder["lease_s"] == 900 and holder["renewed_ago_s"] == 10


@pytest.mark.usefixtures("no_base_run")
def test_health_wait_stops_when_the_lock_was_lost(lock: Path) -> None:
    clock = Clock()
    take(lock, clock)
    args = {**PROBE_ARGS, "lock_path": str(lock), "lock_token": "someone-elses"}
    action = FakeWait(args, ["starting"], lock, clock)
    got = action.run(task_vars={})
    assert got["failed"] and got["lock_lost"] is True
    assert got["msg"].startswith("sglang@kimi.service: stopped waiting: lost the lock")
    assert "now held by alice@ctl-1" in got["msg"]
    assert action.calls == ["fleet_lock"]


@pytest.mark.usefixtures("no_base_run")
def test_health_wait_without_lock_arguments_never_touches_a_lock(lock: Path) -> None:
    action = FakeWait(dict(PROBE_ARGS), ["starting", "healthy"], lock, Clock())
    assert action.run(task_vars={})["state"] == "healthy"
    assert action.calls == ["sglang_health_probe"] * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"lock_path": "/run/lock/x"}, "lock_path /run/lock/x needs lock_token"),
        ({"lock_token": "t"}, "need lock_path"),
        ({"lock_path": "/x", "lock_token": "t", "lock_lease_s": 1.5}, "lock_lease_s must be a"),
        ({"lock_path": "/x", "lock_token": "t", "lock_renew_interval": "0"}, "lock_renew_interval"),
    ],
)
def test_health_wait_lock_arguments_are_checked(args: dict[str, Any], message: str) -> None:
    with pytest.raises(wait.AnsibleActionFail, match=message):
        wait.LeaseRenewal.from_args(dict(args))


def test_check_mode_has_no_token_to_renew(lock: Path) -> None:
    assert wait.LeaseRenewal.from_args({"lock_path": "/x", "lock_token": ""}, True) is None
    params = {
        "path": str(lock),
        "state": "renewed",
        "owner": None,
        "run_id": None,
        "token": "",
        "lease_s": None,
        "replace_sha256": None,
    }
    assert mod.bad_params(params, True) == ""
    assert mod.run(params, True)["outcome"] == "not_held"
    assert "needs the token" in mod.bad_params(params, False)


def test_renewal_interval_defaults_to_a_third_of_the_lease_at_most_a_minute() -> None:
    renewal = wait.LeaseRenewal("/x", "t", None, None)
    assert renewal.due()
    before = time.monotonic()
    renewal.renewed(90)
    assert before + 29 < renewal._next <= time.monotonic() + 30
    renewal.renewed(900)
    assert renewal._next <= time.monotonic() + 60 and not renewal.due()


# ------------------------------------------------------------------- through ansible-playbook

HOLD = """
- name: Hold the lock until the test says go
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Take the lock
      fleet_lock:
        path: "{{ lock }}"
        lease_s: 1
      register: lk
    # The mark appears while this task runs, so a test that sees it knows a worker is busy.
    - name: Work until the test says go (a stand-in for a restart and a health wait)
      ansible.builtin.shell:
        cmd: >-
          echo working > {{ mark | quote }};
          until [ -e {{ gate | quote }} ]; do sleep 0.1; done
      changed_when: false
    - name: Release the lock
      fleet_lock:
        path: "{{ lock }}"
        state: released
        token: "{{ lk.token }}"
"""

PROBE = """
- name: Try to take the lock and write down what happened
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Take the lock
      fleet_lock:
        path: "{{ lock }}"
      register: lk
      failed_when: false
    - name: Write the result for the test
      ansible.builtin.copy:
        content: "{{ lk | to_json }}"
        dest: "{{ out }}"
        mode: "0644"
      check_mode: false
    - name: Release the lock
      fleet_lock:
        path: "{{ lock }}"
        state: released
        token: "{{ lk.token | default('') }}"
"""


def _ansible(tmp_path: Path, book: str, *extra: str) -> list[str]:
    ansible = ROOT / ".venv" / "bin" / "ansible-playbook"
    if not ansible.exists():
        pytest.skip("control-node venv missing")
    path = tmp_path / f"{book.split()[2].lower()}.yml"
    path.write_text(book)
    variables = {"lock": str(tmp_path / "host.lock"), "gate": str(tmp_path / "go")}
    return [
        str(ansible),
        "-i",
        "localhost,",
        "-c",
        "local",
        str(path),
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-e",
        json.dumps(variables),
        *extra,
    ]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_NOCOLOR": "1",
    }


def _probe(tmp_path: Path, name: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        _ansible(tmp_path, PROBE, "-e", f"out={out}", *extra),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {**json.loads(out.read_text()), "output": done.stdout + done.stderr}


@pytest.mark.slow
def test_two_runs_at_once_one_wins_the_other_names_the_holder(tmp_path: Path) -> None:
    runs = [
        subprocess.Popen(
            _ansible(tmp_path, HOLD, "-e", f"mark={tmp_path / name}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )
        for name in ("a", "b")
    ]
    try:
        _wait_for(lambda: any(run.poll() is not None for run in runs), timeout=120)
        loser = next(run for run in runs if run.poll() is not None)
        winner = next(run for run in runs if run is not loser)
        output = loser.communicate(timeout=10)[0]
        assert loser.returncode != 0, output
        flat = " ".join(output.split())  # the callback wraps long lines
        holder = f"localhost is locked by {_user()}@{act.socket.gethostname()} (pid {winner.pid}"
        assert f"{holder}, playbook hold.yml), taken " in flat, output
        assert re.search(r"taken \d+ s ago by the host's clock, lease (ends in|ended) ", flat)
        assert f"that run still has 1 process(es) on this controller: pid {winner.pid}" in flat
        (tmp_path / "go").touch()
        assert winner.wait(timeout=120) == 0
        assert not (tmp_path / "host.lock").exists()
    finally:
        (tmp_path / "go").touch()
        for run in runs:
            run.kill()
            run.communicate(timeout=30)


def _user() -> str:
    return act.user_name(os.geteuid())


@pytest.mark.slow
def test_a_killed_run_whose_worker_still_works_keeps_the_lock(tmp_path: Path) -> None:
    held = subprocess.Popen(
        _ansible(tmp_path, HOLD, "-e", f"mark={tmp_path / 'held'}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    try:
        _wait_for((tmp_path / "held").exists, timeout=120)
        held.send_signal(signal.SIGKILL)
        held.wait(timeout=10)
        blocked = _probe(tmp_path, "blocked")
        assert blocked["outcome"] == "held" and blocked["msg"].startswith("localhost is locked by")
        assert blocked["verdict"]["stale"] is False and len(blocked["verdict"]["pids"]) == 1
        assert f"(pid {held.pid}, playbook hold.yml)" in blocked["msg"]
        assert "lease ended" in blocked["msg"] and "still alive" in blocked["msg"]
        checked = _probe(tmp_path, "checked", "--check")
        assert checked["outcome"] == "held" and checked["msg"].startswith("check mode: localhost")
        assert "a real run would stop here" in checked["output"]
        (tmp_path / "go").touch()
        worker = blocked["verdict"]["pids"][0]
        _wait_for(lambda: act.read_proc(worker) is None, timeout=60)
        taken = _probe(tmp_path, "taken")
        assert taken["outcome"] == "taken_over" and taken["acquired"]
        assert "no process of that run is left on this controller" in taken["msg"]
        assert "took over the lock of" in taken["output"]  # shown as a warning
        assert not (tmp_path / "host.lock").exists()  # the probe released it
    finally:
        (tmp_path / "go").touch()
        held.kill()
        held.wait(timeout=10)
