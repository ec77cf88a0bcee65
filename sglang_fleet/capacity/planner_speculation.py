"""The capacity planner's speculative decoding (docs/SPECULATIVE.md, sglang_fleet.capacity.
speculative): the draft model placed, the 48 reset of --max-running-requests, the draft's
memory, the accept length and step costs, and the speed-up at the planned concurrency.

A mixin of GpuPlanner (gpu_planner.py): it reads the planner's arguments (`args`), model,
layout and `startup_log`, and adds to its `warnings` and `errors`.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from sglang_fleet.capacity import kv_cache
from sglang_fleet.capacity import speculative as spec
from sglang_fleet.capacity.model_config import ModelConfigError
from sglang_fleet.capacity.plan_issues import issue
from sglang_fleet.capacity.planner_inputs import PlanInputError

_FULL_BANDWIDTH = "full bandwidth (the roofline)"


class PlannerSpeculation:
    """The planner's speculative decoding (a mixin: GpuPlanner holds the state it reads)."""

    # --- speculative decoding (sglang_fleet.capacity.speculative) -----------------------
    def _speculation(
        self, config: dict[str, Any]
    ) -> tuple[spec.Settings | None, spec.DraftMemory | None]:
        """The speculative settings SGLang resolves and the draft's memory; bad flags and a
        draft SGLang cannot run with this target are PlanInputErrors naming the flag."""
        try:
            found = spec.settings(self.args, self.shape.architecture)
        except spec.SpeculationError as exc:
            raise PlanInputError(exc.message, exc.flag) from exc
        if found is None or found.algorithm == "NGRAM":
            return found, None
        draft = None
        if found.draft_path is not None:
            draft_config = self.args["speculative_draft_config"]
            draft_bytes = self.args["speculative_draft_weight_bytes"]
            if draft_config is None or draft_bytes is None:
                raise PlanInputError(
                    "the draft model's config.json and checkpoint size are needed to plan its "
                    "memory (the planner reads them from this directory)",
                    "speculative_draft_model_path",
                )
            problems = spec.draft_problems(found.algorithm, config, draft_config)
            if problems:
                raise PlanInputError(
                    f"{found.draft_path}: " + "; ".join(problems), "speculative_draft_model_path"
                )
            draft = (draft_config, draft_bytes)
        try:
            memory = spec.draft_memory(
                found,
                self.shape,
                self.target_cell,
                config,
                draft,
                kv_cache_dtype=self.dtype,
                attn_tp_size=self.layout.attn_tp_size,
            )
        except ModelConfigError as exc:
            raise PlanInputError(str(exc), "speculative_draft_model_path") from exc
        return found, memory

    def draft_budget_cell(self) -> int:
        """Bytes per token 0.5.23 adds to the target's KV budget for the draft's pool."""
        return self.draft.budget_cell_bytes if self.draft else 0

    def max_running_requests(self) -> int | None:
        """--max-running-requests as SGLang resolves it: 48 when speculation resets it."""
        given = self.args["max_running_requests"]
        if given is None and self.spec is not None:
            return spec.RESET_MAX_RUNNING_REQUESTS
        return given

    # --- speculative decoding: the 48 reset, the draft's memory, the speed-up ------------
    def speculation(self, tokens: int, concurrent: int, speed: float) -> dict[str, Any] | None:
        """The plan's speculative section (None without speculation); adds its warnings."""
        if self.spec is None:
            return None
        if self.args["max_running_requests"] is None:
            self._reset_issue(tokens, concurrent)
        out: dict[str, Any] = {
            "settings": self.spec.as_dict(),
            "draft": None if self.draft is None else self.draft.as_dict(),
            "max_running_requests": self.max_running_requests(),
            "reset_to_48": self.args["max_running_requests"] is None,
            # What the pool holds without the reset: the value to set.
            "max_concurrent_requests_without_reset": self.concurrency(tokens, reset=False),
            "kv_budget_cell_bytes": self.target_cell + self.draft_budget_cell(),
        }
        if self.draft is not None:
            beyond = self.draft.beyond_budget_bytes(tokens) / kv_cache.GIB
            out["draft_kv_gib"] = round(self.draft.cell_bytes * tokens / kv_cache.GIB, 3)
            out["draft_kv_beyond_budget_gib"] = round(beyond, 3)
            if beyond > 0:
                self.warnings.append(
                    issue(
                        "speculative_draft_kv_beyond_budget",
                        f"The draft's own KV pool ({self.draft.cell_bytes} B/token: "
                        f"{self.draft.layers} {self.draft.attention} layer(s)) is larger than the "
                        "share SGLang 0.5.23 budgets for it in the target's pool "
                        f"({self.draft.budget_cell_bytes} B/token: the target's per-layer size x "
                        f"{self.draft.budget_layers}): {beyond:.2f} GiB per GPU comes out of the "
                        "memory outside the static pool, where CUDA graphs and prefill run.",
                    )
                )
        out |= self.speedup_section(concurrent, speed)
        return out

    def _reset_issue(self, tokens: int, concurrent: int) -> None:
        fits = self.concurrency(tokens, reset=False)
        job = self.args["job_concurrency"]
        per_rank = (
            f" ({spec.RESET_MAX_RUNNING_REQUESTS // self.attn_dp} per attention-DP rank)"
            if self.attn_dp > 1
            else ""
        )
        capped = (
            f"the job's {job} concurrent requests would run {concurrent} at a time and the rest "
            "wait in the queue"
            if job and job > concurrent
            else f"any load above {concurrent} concurrent requests waits in the queue"
        )
        message = (
            "--max-running-requests is not given: SGLang 0.5.23 resets it to "
            f"{spec.RESET_MAX_RUNNING_REQUESTS} for speculative decoding ('Max running requests "
            "is reset to 48 for speculative decoding'), so this server runs at most "
            f"{concurrent} requests at once{per_rank}: {capped}. Set --max-running-requests "
            f"{fits} (max_running_requests: {fits}), the plan's max concurrent requests "
            "without the reset."
        )
        mode = self.args["speculation_reset"]
        (self.errors if mode == "refuse" else self.warnings).append(issue(spec.RESET_CODE, message))

    def accept_length(self) -> tuple[float | None, str]:
        if self.args["speculative_accept_length"] is not None:
            return float(self.args["speculative_accept_length"]), "argument"
        if self.startup_log is not None and (found := self.startup_log.accept_length()) is not None:
            return found, "calibration log (accept len)"
        return None, ""

    def step_costs(self) -> tuple[spec.StepCosts | None, str]:
        """The speed-up model's inputs, or why they are missing."""
        bandwidth, bw_source = self.bandwidth()
        if bandwidth is None:
            return None, bw_source
        if self.args["gpu_bf16_tflops"]:
            tflops, key = float(self.args["gpu_bf16_tflops"]), "gpu_bf16_tflops"
        else:
            tflops, key = spec.gpu_bf16_tflops(self.host.get("gpu_name"))
        if tflops is None:
            return None, (
                f"peak BF16 TFLOPS of GPU {self.host.get('gpu_name')!r} unknown: set "
                "gpu_bf16_tflops (--gpu-bf16-tflops)"
            )
        context = self.args["avg_input_len"] + self.args["avg_output_len"] // 2
        draft = self.draft
        costs = spec.StepCosts(
            weights=self.weights,
            layout=self.layout,
            cell_bytes=self.target_cell,
            context_tokens=context,
            bandwidth_gbs=bandwidth,
            tflops=tflops,
            flops_per_token=spec.flops_per_token(self.config, self.shape, self.layout, context),
            draft_weights_per_gpu_bytes=draft.weights_per_gpu_bytes if draft else 0.0,
            draft_cell_bytes=draft.cell_bytes if draft else 0,
            # A draft's weights are mostly bf16: 2 FLOPs per parameter, 2 bytes each.
            draft_flops_per_token=draft.weights_per_gpu_bytes if draft else 0.0,
            efficiency=1.0,
        )
        return costs, f"{bw_source}; {tflops:g} TFLOPS BF16 ({key})"

    def _measured_efficiency(self, costs: spec.StepCosts) -> tuple[float, str]:
        """The memory efficiency a calibration log's plain Decode batch lines show, else 1."""
        startup = self.startup_log
        if startup is None or startup.accept_length() is not None:
            return 1.0, _FULL_BANDWIDTH
        running = [s.num_running_reqs for s in startup.decode_samples if s.num_running_reqs > 0]
        speed = startup.per_request_tok_s()
        if not running or not speed:
            return 1.0, _FULL_BANDWIDTH
        batch = statistics.median(running)
        found = spec.efficiency_from(costs, batch, speed)
        if found is None:
            return 1.0, _FULL_BANDWIDTH
        return found, (
            f"{found:.2f} of the bandwidth, as the calibration log's decode measured "
            f"({speed:.1f} tok/s per request at {batch:g} running)"
        )

    def speedup_section(self, concurrent: int, speed: float) -> dict[str, Any]:
        accept, accept_source = self.accept_length()
        if accept is None:
            return {
                "speedup": None,
                "speedup_reason": "no accept length: give speculative_accept_length "
                "(--speculative-accept-length), or a calibration log whose Decode batch lines "
                "carry accept len",
            }
        costs, source = self.step_costs()
        if costs is None:
            return {"speedup": None, "speedup_reason": source, "accept_length": accept}
        efficiency, basis = self._measured_efficiency(costs)
        costs = dataclasses.replace(costs, efficiency=efficiency)
        job = self.args["job_concurrency"]
        found = spec.curve(costs, self.spec, accept, [concurrent, job or 0])
        at_planned = spec.speedup(costs, self.spec, accept, max(concurrent, 1))
        out = {
            "accept_length": accept,
            "accept_length_source": accept_source,
            "model": f"memory at {basis}; {source}",
            "speedup": found,
            "speedup_at_planned_concurrency": round(at_planned, 3),
            "planned_output_tok_s_without": round(concurrent * speed, 1),
            "planned_output_tok_s_with": round(concurrent * speed * at_planned, 1),
        }
        if job:
            out["speedup_at_job_concurrency"] = round(
                spec.speedup(costs, self.spec, accept, job), 3
            )
        return out
