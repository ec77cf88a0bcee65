"""The capacity plan of a CPU server (`device: cpu`, docs/CPU-SERVERS.md): host RAM.

SGLang's CPU engine sizes the KV pool from the host's free RAM unless --max-total-tokens caps
it, so the plan is of host RAM instead of GPU memory: weights + max_total_tokens x cell size x
ranks + process overhead must fit host_ram_gib x CPU_RAM_FRACTION. Without max_total_tokens it
is an error that names the cap that fits; no GPU fact is needed.
"""

from __future__ import annotations

from typing import Any

from sglang_fleet.capacity import kv_cache, speculative
from sglang_fleet.capacity.gpu_planner import GpuPlanner
from sglang_fleet.capacity.model_config import ModelConfigError, model_shape
from sglang_fleet.capacity.plan_issues import issue
from sglang_fleet.capacity.planner_inputs import (
    PlanInputError,
    check_inputs,
    check_weight_bytes,
    merge_args,
    parse_startup_log,
    typed_host,
)


class CpuPlanner(GpuPlanner):
    """A CPU server's plan (docs/CPU-SERVERS.md): host RAM and --max-total-tokens."""

    def __init__(
        self, config: dict[str, Any], weight_bytes: int, args: dict[str, Any], host: dict[str, Any]
    ):
        self.args = merge_args(args)
        self.host = typed_host(host, "cpu")
        check_inputs(self.args)
        try:
            self.shape = model_shape(config)
        except ModelConfigError as exc:
            raise PlanInputError(str(exc), "model_config") from exc
        self.weight_bytes = check_weight_bytes(weight_bytes)
        self.warnings = []
        self.errors = []
        self.layout = self._layout()
        self.tp = self.layout.tp_size
        self.dp = self.layout.dp_size
        self.attn_dp = self.layout.attn_dp_size
        self.dtype = str(self.args["kv_cache_dtype"])
        # On CPU only the flags and the 48 reset are planned (NGRAM runs there; a draft's
        # host RAM is not modeled): docs/SPECULATIVE.md.
        self.spec, self.draft = self._cpu_speculation()
        self.startup_log = parse_startup_log(self.args)
        ram = self.host.get("host_ram_gib")
        self.ram_gib = None if ram is None else float(ram)

    def _cpu_speculation(self) -> tuple[speculative.Settings | None, None]:
        try:
            found = speculative.settings(self.args, self.shape.architecture)
        except speculative.SpeculationError as exc:
            raise PlanInputError(exc.message, exc.flag) from exc
        if found is not None and found.algorithm != "NGRAM":
            raise PlanInputError(
                f"{found.algorithm} on the CPU engine: the planner does not model a draft "
                "model's host RAM; NGRAM (no draft model) is planned",
                "speculative_algorithm",
            )
        return found, None

    def _speculative_section(self, cell: int) -> dict[str, Any]:
        assert self.spec is not None
        return {
            "settings": self.spec.as_dict(),
            "draft": None,
            "max_running_requests": self.max_running_requests(),
            "reset_to_48": self.args["max_running_requests"] is None,
            "kv_budget_cell_bytes": cell,
            "speedup": None,
            "speedup_reason": "not modeled on the CPU engine",
        }

    def _tokens(self, cell: int) -> tuple[int, int | None]:
        """(tokens planned, the cap that fits host RAM or None when RAM is unknown)."""
        page = int(self.args["page_size"])
        fitting = None
        if self.ram_gib is not None:
            budget = self.ram_gib * kv_cache.CPU_RAM_FRACTION
            fitting = kv_cache.cpu_tokens_fitting(
                budget,
                self.weight_bytes,
                cell_size=cell,
                tp_size=self.tp,
                dp_size=self.dp,
                page_size=page,
            )
        given = self.args["max_total_tokens"]
        if given is not None:
            return int(given) // page * page, fitting
        hint = f" ({fitting} fit in {kv_cache.CPU_RAM_FRACTION:.0%} of host RAM)" if fitting else ""
        self.errors.append(
            issue(
                "cpu_max_total_tokens",
                "A CPU server needs --max-total-tokens: SGLang's CPU engine sizes the KV pool "
                f"from the host's free RAM unless it is capped, taking most of it{hint}; cap it "
                "at what the workload needs.",
            )
        )
        return fitting or 0, fitting

    def check_ram(self, tokens: int, needed_gib: float, fitting: int | None) -> None:
        if self.ram_gib is None:
            self.warnings.append(
                issue("host_ram_unknown", "host_ram_gib is not known: host RAM is not checked.")
            )
            return
        budget = self.ram_gib * kv_cache.CPU_RAM_FRACTION
        if needed_gib > budget:
            self.errors.append(
                issue(
                    "cpu_host_ram",
                    f"max_total_tokens {tokens} needs {needed_gib:.2f} GiB of host RAM (weights "
                    f"{self.weight_bytes * self.dp / kv_cache.GIB:.2f} GiB, KV and process "
                    f"overhead), more than {kv_cache.CPU_RAM_FRACTION:.0%} of the host's "
                    f"{self.ram_gib:.1f} GiB; at most {fitting or 0} tokens fit.",
                )
            )

    def check_ignored(self) -> None:
        ignored = [k for k in ("mem_fraction_static", "enable_hierarchical_cache") if self.args[k]]
        if self.args["calibration"] or self.args["calibration_log"]:
            ignored.append("calibration (GPU memory records)")
        if ignored:
            self.warnings.append(
                issue(
                    "cpu_ignored",
                    f"Not planned for a CPU server: {', '.join(ignored)}; the CPU plan is of "
                    "host RAM and max_total_tokens.",
                )
            )

    def run(self) -> dict[str, Any]:
        cell = kv_cache.cell_size_bytes(self.shape, self.dtype, self.tp)
        tokens, fitting = self._tokens(cell)
        kv_bytes = kv_cache.cpu_kv_bytes(cell, self.tp, self.dp, tokens)
        needed = kv_cache.cpu_host_ram_gib(self.weight_bytes, kv_bytes, self.tp, self.dp)
        self.check_ram(tokens, needed, fitting)
        self.check_ignored()
        self.check_dtype()
        self.check_context()
        concurrent = self.concurrency(tokens)
        if self.spec is not None and self.args["max_running_requests"] is None:
            self._reset_issue(tokens, concurrent)
        speed, speed_source = self.per_request_tok_s()
        headroom = None if self.ram_gib is None else self.ram_gib - needed
        return {
            "cell_size_bytes": cell,
            "max_total_num_tokens": tokens,
            "max_concurrent_requests": concurrent,
            "kv_bound_output_tok_s": round(concurrent * speed, 1),
            # Host RAM left once the server is up (GPU plans: outside the static pool).
            "headroom_gib": None if headroom is None else round(headroom, 2),
            "hicache_host_gib_total": 0.0,
            "speculative": None
            if self.spec is None
            else {
                "settings": self.spec.as_dict(),
                "max_running_requests": self.max_running_requests(),
            },
            "warnings": self.warnings,
            "errors": self.errors,
            "details": {
                "device": "cpu",
                "attention": self.shape.attention,
                "architecture": self.shape.architecture,
                "kv_cache_dtype": self.dtype,
                "kv_pool_gib": round(kv_bytes / kv_cache.GIB, 3),
                "weights_gib": round(self.weight_bytes * self.dp / kv_cache.GIB, 3),
                "host_ram_needed_gib": round(needed, 3),
                "host_ram_gib": self.ram_gib,
                "max_total_tokens_fitting": fitting,
                "calibrated": False,
                "calibration": None,
                "tokens_per_request": self.args["avg_input_len"] + self.args["avg_output_len"],
                "per_request_tok_s": round(speed, 2),
                "per_request_tok_s_source": speed_source,
                "dp_size": self.dp,
            },
        }
