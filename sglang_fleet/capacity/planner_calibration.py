"""The capacity planner's calibration (docs/CALIBRATION.md): two paths, apart, that meet once.

- the store path (`_stored_records`): the records the deploy stored on the host, given as data
  (`calibration`), read once by the store's rule; what it sets aside is named, never a warning;
- the log path (`_logged_record`): a start-up log given to plan from (`calibration_log`),
  parsed once, its run's own flags inferred and checked (`_logged_run_flags`), built into a
  record.

`_apply_calibration` hands both paths' records to calibration_apply.apply (match, predict,
judge) as read. A mixin of GpuPlanner (gpu_planner.py): it reads the planner's arguments
(`args`), model (`shape`, `weights`), layout (`tp`, `dp`, `attn_dp`), `fraction`, `draft`,
`gpu_mib` and `host`, and adds to its `warnings`, `errors`, `calibration_set_aside` and
`calibration_log_flags`.
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import (
    attention_dp,
    calibration,
    calibration_apply,
    calibration_record,
    calibration_store,
    logged_flags,
)
from sglang_fleet.capacity import speculative as spec
from sglang_fleet.capacity.plan_issues import issue
from sglang_fleet.capacity.planner_inputs import PlanInputError
from sglang_fleet.capacity.server_log import StartupLog


class PlannerCalibration:
    """The planner's calibration paths (a mixin: GpuPlanner holds the state they read)."""

    def _calibration_flags(self) -> dict[str, Any]:
        """The flag set as SGLang will see it: the server's flags under the planner's."""
        flags = dict(self.args["server_flags"] or {})
        for key in (
            "tp_size",
            "dp_size",
            "kv_cache_dtype",
            "chunked_prefill_size",
            "max_running_requests",
            "context_length",
            "page_size",
            "cuda_graph_max_bs_decode",
            *spec.FLAGS,
        ):
            if self.args[key] is not None:
                flags[key] = self.args[key]
        flags.pop("enable_dp_attention", None)
        flags |= {"dp_size": self.dp, "attn_dp_size": self.attn_dp}
        flags["mem_fraction_static"] = self.fraction
        return flags

    def _stored_records(self) -> calibration_store.StoreRead:
        """The store path: the host's records given as data (`calibration`), read once by the
        store's rule; the entries no plan may use are named in calibration_set_aside."""
        read = calibration_store.read_store(self.args["calibration"])
        self.calibration_set_aside += [entry.describe() for entry in read.set_aside]
        return read

    def _logged_record(self) -> dict[str, Any] | None:
        """The log path: a record built from the calibration log (parsed once, in self.startup_log)
        with the flags its run had (_logged_run_flags); None without a log, or with a log too
        incomplete to plan from (a calibration_incomplete warning). What build_record returns
        has passed the store's rule."""
        if self.startup_log is None:
            return None
        logged = {"logged_flags": self._logged_run_flags(self.startup_log)}
        try:
            return calibration_record.build_record(self.startup_log, None, logged)
        except calibration.CalibrationError as exc:
            self.warnings.append(
                issue(
                    "calibration_incomplete",
                    f"The calibration log is incomplete: {exc}; using estimates instead.",
                )
            )
            return None

    def _logged_run_flags(self, startup: StartupLog) -> dict[str, Any]:
        """The logged run's own flags (sglang_fleet.capacity.logged_flags): what the log or the
        operator
        states (`calibration_log_flags`), checked against its lines, the rest inferred from
        them, each named with its source in calibration_log_flags; never the flags being
        planned. A flag that matters and that nothing fixes refuses the log."""
        if not startup.has_memory:
            return {}  # build_record names what is missing
        stated = self.args["calibration_log_flags"] or {}
        run = logged_flags.infer(startup, self.shape, self.weights, stated=stated)
        if run.unknown:
            names = ", ".join(run.unknown)
            raise PlanInputError(
                f"the calibration log does not say which {names} it ran with, and its lines "
                "cannot fix it: give the logged run's value with --logged-flag NAME=VALUE (the "
                "planner's own flags describe the plan, not the log)",
                "calibration_log",
            )
        tp, attn = run.flags.get("tp_size"), run.flags.get("attn_dp_size")
        if isinstance(tp, int) and isinstance(attn, int) and (attn < 1 or tp % attn):
            # SGLang refuses a start whose attention DP does not divide tp: no log has one.
            raise PlanInputError(
                f"the logged run's attn_dp_size {attn} ({run.sources['attn_dp_size']}) does not "
                f"divide its tp_size {tp} ({run.sources['tp_size']})",
                "calibration_log_flags",
            )
        for problem in run.disagreements:
            self.warnings.append(
                issue("calibration_flags_disagree", f"The calibration log disagrees: {problem}.")
            )
        self.calibration_log_flags += run.describe()
        return run.flags

    def _apply_calibration(
        self, config: dict[str, Any], weight_bytes: int
    ) -> calibration_apply.Applied | None:
        stored = self._stored_records()
        logged = self._logged_record()
        records = stored.records + ([logged] if logged is not None else [])
        if not records:
            return None
        host = {
            "gpu_memory_mib": self.gpu_mib,
            "gpu_name": self.host.get("gpu_name"),
            "sglang_version": self.args["sglang_version"],
            "model_fingerprint": calibration_record.model_fingerprint(config, weight_bytes),
            "architecture": self.shape.architecture,
        }
        try:
            # Both paths' records have passed the store's rule: handed over as read, not reread.
            applied = calibration_apply.apply(
                calibration_store.StoreRead(records, []),
                self._calibration_flags(),
                host,
                self.shape,
                margin_gib=float(self.args["min_free_after_graph_gib"]),
                mode=str(self.args["calibration_mode"]),
                flags_complete=self.args["server_flags"] is not None,
                extra_weight_gib=lambda n: attention_dp.extra_weight_gib(self.weights, self.tp, n),
                draft_budget_layers=self.draft.budget_layers if self.draft else 0,
            )
        except calibration.CalibrationError as exc:
            raise PlanInputError(str(exc)) from exc
        self.warnings += applied.warnings
        self.errors += applied.errors
        return applied
