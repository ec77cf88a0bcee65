"""Action sglang_smoke_gate: measure a freshly started server and gate on the result.

One operator verb, sequenced on the controller through modules on the host (as
`ansible.builtin.reboot` sequences its own); the decisions are sglang_fleet's (smoke_argv,
gate.evaluate, gate.compact, run_diagnosis.diagnose):

1. on the host, in one module run (plugins/modules/sglang_smoke_run.py): the client (the installed
   sglang_fleet package's smoke client as one zipapp, standard library only, built by
   sglang_fleet.host_zipapp) written where it differs, the
   benchmark run with the server's API key on stdin (never argv, never a result: the run is
   under no_log), bounded by coreutils' timeout, its result and this start's journal read back,
   and with max_regression_pct the last-known-good record too (no module run of its own);
2. the result kept on the control node (reports_dir/<host>/<server>/<UTC stamp>.json), with the
   picture beside it (sglang_fleet.smoke.smoke_picture in the controller's Python, started as a
   process of its own that the gate does not wait for: matplotlib's import and drawing took
   1-2 s of the gate's own time; what it says goes to <stamp>.png.log; a picture that cannot
   be started is said, and no picture is ever gated on);
3. the diagnosis of what bounds the server (its /metrics samples in the result, else this
   start's journal), kept beside the result;
4. the verdict: every threshold, every request's output tokens, and with max_regression_pct the
   result the last-known-good configuration passed with (its record on the host).

With `lock` ({path, token, lease_s}: the rollout lock this run holds) the lease is renewed for
lease_s plus the benchmark's timeout before it runs, and back to lease_s after; a lock another
run took over fails the gate with lock_lost: true (do not roll back then).

The result: passed, summary, lines (what the role shows), measured (what the fleet summary
shows: server, passed, summary, output_throughput, p99_ttft_ms, verdict, report), passed_result
(on a pass: what last-known-good keeps), report, benchmark_s (the client's own run) and steps;
the role registers it as smoke_gate_run. A failed gate fails the task with "smoke gate: ..."
(the caller rolls back); `measured` is in that failure too. Check mode: nothing was started,
nothing runs.
"""

from __future__ import annotations

import base64
import datetime
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.sglang_fleet.fleet.plugins.plugin_utils import controller_package

# The controller package sglang_fleet: a plugin imports without it and fails when used,
# naming the command that installs it (plugins/plugin_utils/controller_package.py).
try:
    from sglang_fleet.module_utils.bounded_json import loads as bounded_loads

    from sglang_fleet.diagnosis.run_diagnosis import diagnose
    from sglang_fleet.host_zipapp import build as build_zipapp
    from sglang_fleet.rollout.verb_action import StepFailed, VerbAction
    from sglang_fleet.smoke import gate
    from sglang_fleet.smoke.smoke_argv import smoke_argv
except ImportError as error:
    PACKAGE_ERROR: ImportError | None = error
    VerbAction = ActionBase  # only run() is called, and it fails first
else:
    PACKAGE_ERROR = None

# The client's entry module: the host gets it and what it imports as one zipapp.
SMOKE_CLIENT = "sglang_fleet.smoke.smoke_client.command_line"
REQUIRED = ("server", "workload", "python", "client_path", "state_dir", "reports_dir")
OPTIONAL = ("api_key", "timeout", "journal_lines", "thresholds", "lock")
THRESHOLDS = (
    "min_output_tok_s",
    "max_p99_ttft_ms",
    "max_p99_tpot_ms",
    "max_failure_rate",
    "min_goodput",
    "max_regression_pct",
)
# A result JSON is a few hundred kB for the smoke workloads; more is not a smoke result.
MAX_RESULT_BYTES = 64 * 1024 * 1024
PICTURE_TIMEOUT_S = 120
# The last-known-good record the relative gate reads: a few kilobytes.
MAX_BASELINE_BYTES = 1024 * 1024


class ActionModule(VerbAction):
    """Runs the smoke client on the host, reports on the controller, judges the result."""

    VERB = "sglang_smoke_gate"
    _VALID_ARGS = frozenset((*REQUIRED, *OPTIONAL))

    def run(self, tmp: Any = None, task_vars: dict | None = None) -> dict:
        controller_package.require(PACKAGE_ERROR)
        result = super().run(tmp, task_vars)
        args = self.task_args(REQUIRED, ("name", "port"))
        server = args["server"]
        unknown = sorted(set(args.get("thresholds") or {}) - set(THRESHOLDS))
        if unknown:
            raise AnsibleActionFail(
                f"sglang_smoke_gate: unknown threshold(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(THRESHOLDS)}"
            )
        self.begin(task_vars)
        name = str(server["name"])
        if self._play_context.check_mode:
            prompts = (args.get("workload") or {}).get("num_prompts")
            result.update(
                skipped=True,
                msg=f"{name} would be benchmarked ({prompts} requests) and gated "
                "(check mode: nothing runs)",
            )
            return result
        lock = dict(args.get("lock") or {})
        timeout = int(args.get("timeout") or 600)
        try:
            # The lease covers the whole benchmark, then goes back to the usual one.
            self._renew(lock, int(lock.get("lease_s") or 0) + timeout)
            try:
                measured = self._measure(server, args)
            finally:
                self._renew(lock)
        except StepFailed as exc:
            result.update(
                failed=True,
                msg=str(exc),
                lock_lost=exc.lock_lost,
                steps=self._steps,
                measured={},
            )
            return result
        return self._judge(result, server, args, measured)

    # --- steps -----------------------------------------------------------------------------
    def _fail_unless(self, done: Mapping[str, Any], what: str) -> None:
        if done.get("failed"):
            raise AnsibleActionFail(f"sglang_smoke_gate: {what}: {done.get('msg')}")

    def _measure(self, server: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
        name, client = str(server["name"]), str(args["client_path"])
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        remote_json = f"{args['state_dir']}/{name}/smoke/{stamp}.json"
        host = str(self._vars.get("inventory_hostname", "host"))
        local_base = Path(str(args["reports_dir"])).resolve() / host / name / stamp
        timeout = int(args.get("timeout") or 600)
        try:
            argv = smoke_argv(
                dict(args["workload"]),
                python=str(args["python"]),
                client=client,
                port=int(server["port"]),
                json_path=remote_json,
                timeout=timeout,
            )
        except gate.GateInputError as exc:
            raise AnsibleActionFail(str(exc)) from None
        started = time.monotonic()
        # One module run on the host: the client in place, the benchmark with the key on stdin,
        # the result and this start's journal read back (plugins/modules/sglang_smoke_run.py).
        with self._quiet():
            ran = self._module(
                "sglang_smoke_run",
                {
                    "client_zipapp": base64.b64encode(build_zipapp(SMOKE_CLIENT)).decode(),
                    "client_path": client,
                    "result_path": remote_json,
                    "argv": argv,
                    "api_key": str(args.get("api_key") or ""),
                    "max_result_bytes": MAX_RESULT_BYTES,
                    "journal_unit": str(server.get("unit") or ""),
                    "journal_lines": int(args.get("journal_lines") or 0),
                    "baseline_path": self._baseline_path(server, args),
                    "max_baseline_bytes": MAX_BASELINE_BYTES,
                },
            )
        benchmark_s = round(time.monotonic() - started, 2)
        self._fail_unless(ran, "running the benchmark")
        rc = ran.get("rc")
        if rc != 0:
            how = (
                f"it ran past smoke_gate_timeout ({timeout} s)"
                if rc in (124, 137)
                else f"exit status {rc}"
            )
            stderr = str(ran.get("stderr_tail") or "").strip()
            if len(stderr) > 600:
                stderr = stderr[:597] + "..."
            raise StepFailed(f"smoke benchmark of {name} failed: {how}: {stderr}")
        self._step(f"benchmark of {name} ran to the end ({benchmark_s} s)")
        raw = ran.get("result")
        if raw is None:
            raise AnsibleActionFail(f"sglang_smoke_gate: the benchmark wrote no {remote_json}")
        local_base.parent.mkdir(parents=True, exist_ok=True)
        json_path = local_base.with_name(stamp + ".json")
        json_path.write_text(raw, encoding="utf-8")
        try:
            measured = bounded_loads(raw, remote_json)
        except ValueError as exc:
            raise AnsibleActionFail(f"sglang_smoke_gate: {remote_json}: {exc}") from None
        if not isinstance(measured, dict):
            raise AnsibleActionFail(f"sglang_smoke_gate: {remote_json} is not a result")
        self._step(f"result kept in {json_path}")
        return {
            "result": measured,
            "local_base": str(local_base),
            "json": str(json_path),
            "benchmark_s": benchmark_s,
            "journal": str(ran.get("journal") or ""),
            "baseline": ran.get("baseline"),
        }

    def _picture(self, base: str) -> str:
        """Starts drawing the PNG beside the result, off the rollout's path ("" when started,
        else why not): a process of its own in the controller's Python, in a session of its own
        (an interrupted playbook does not cut it short), bounded by coreutils' timeout where the
        controller has it; what it says goes to <base>.png.log."""
        python = str(self._vars.get("ansible_playbook_python") or sys.executable)
        argv = [python, "-m", "sglang_fleet.smoke.smoke_picture", base + ".json", base + ".png"]
        bound = shutil.which("timeout")
        if bound:
            argv = [bound, str(PICTURE_TIMEOUT_S), *argv]
        try:
            with open(base + ".png.log", "wb") as log:
                subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            return str(exc)
        return ""

    @staticmethod
    def _baseline_path(server: Mapping[str, Any], args: Mapping[str, Any]) -> str:
        """The last-known-good record the relative gate reads ("" without max_regression_pct)."""
        if (args.get("thresholds") or {}).get("max_regression_pct") is None:
            return ""
        return f"{args['state_dir']}/{server['name']}/lkg/meta.json"

    @staticmethod
    def _baseline(raw: Any, path: str) -> Any:
        """The result last-known-good passed with, from its record's text (read on the host in
        the benchmark's module run); None when there is no record or it cannot be read."""
        if not raw or not isinstance(raw, str):
            return None
        try:
            record = bounded_loads(raw, path)
        except ValueError:
            return None
        return record.get("smoke_result") if isinstance(record, dict) else None

    def _judge(
        self, result: dict, server: Mapping[str, Any], args: Mapping[str, Any], got: dict
    ) -> dict:
        name, measured, base = str(server["name"]), got["result"], got["local_base"]
        no_picture = self._picture(base)
        self._step("picture being drawn" if not no_picture else f"no picture: {no_picture}")
        journal = got["journal"]
        concurrency = (args.get("workload") or {}).get("max_concurrency")
        diagnosis = diagnose(measured, journal or None, int(concurrency) if concurrency else None)
        Path(base + ".diagnosis.json").write_text(json.dumps(diagnosis, indent=4) + "\n")
        self._step(f"diagnosis: {diagnosis.get('verdict')}")
        try:
            baseline = self._baseline(got["baseline"], self._baseline_path(server, args))
            verdict = gate.evaluate(measured, dict(args.get("thresholds") or {}), baseline)
        except gate.GateInputError as exc:
            raise AnsibleActionFail(f"sglang_gate: {exc}") from None
        self._step(verdict["summary"])
        shown = {
            "server": name,
            "passed": verdict["passed"],
            "summary": verdict["summary"],
            "output_throughput": measured.get("output_throughput"),
            "p99_ttft_ms": measured.get("p99_ttft_ms"),
            "verdict": diagnosis.get("verdict"),
            "report": got["json"],
        }
        passed = gate.compact(measured, diagnosis, got["json"]) if verdict["passed"] else None
        host = str(self._vars.get("inventory_hostname", "host"))
        result.update(
            changed=True,  # a new result on the host and a report on the control node
            passed=verdict["passed"],
            summary=verdict["summary"],
            failures=verdict["failures"],
            lines=result_lines(host, name, measured, verdict, diagnosis, no_picture, base),
            measured=shown,
            passed_result=passed,
            report=got["json"],
            benchmark_s=got["benchmark_s"],
            steps=self._steps,
        )
        if not verdict["passed"]:
            result.update(
                failed=True,
                msg=f"smoke gate: {verdict['summary']}; diagnosis: {diagnosis.get('verdict')}; "
                f"report: {got['json']}",
            )
        else:
            result["msg"] = f"{host} {name}: {verdict['summary']}"
        return result


def result_lines(  # noqa: PLR0917 (one line each, as the role shows them)
    host: str,
    name: str,
    measured: Mapping[str, Any],
    verdict: Mapping[str, Any],
    diagnosis: Mapping[str, Any],
    no_picture: str,
    base: str,
) -> list[str]:
    """What the role shows of one run: the verdict, the load, the diagnosis, the files."""
    load = (
        f"requests {measured.get('completed')} completed in "
        f"{float(measured.get('duration') or 0):.1f} s at concurrency "
        f"{float(measured.get('concurrency') or 0):.1f}"
    )
    if measured.get("goodput") is not None:
        load += f", goodput {float(measured['goodput']):.3f}"
    metrics = measured.get("server_metrics") or {}
    if metrics:
        load += (
            f"; server peak running/queued {metrics.get('peak_num_running_reqs')}/"
            f"{metrics.get('peak_num_queue_reqs')}, peak token usage "
            f"{metrics.get('peak_token_usage')}"
        )
    lines = [f"{host} {name}: {verdict['summary']}", load, f"diagnosis: {diagnosis.get('verdict')}"]
    lines += [f"  lever: {lever['message']}" for lever in (diagnosis.get("levers") or [])[:2]]
    lines += [
        "picture: none" if no_picture else f"picture: {base}.png (drawn beside the rollout)",
        f"result: {base}.json",
    ]
    return lines
