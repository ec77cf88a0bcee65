"""What a logged SGLang start ran with, read from its own lines (docs/CALIBRATION.md, "A log's
own flags").

A full log states its flags (`server_args=`); an excerpt an operator pastes often does not. The
flags a plan needs from the logged run are fixed by the memory lines themselves, through SGLang's
own formula (kv_cache.rest_gib: rest = post - pre x (1 - f) - reserve, and the pool takes rest):

- kv_cache_dtype: the `KV Cache is allocated. dtype: torch.X` line, cross-checked against the
  cell size, KV size / #tokens;
- tp_size and attn_dp_size: the rank tags of the lines' prefix (SGLang writes " DP<d>" with
  attention DP and " TP<t>" with tp > 1, none at tp 1), and the weights per GPU the
  `Load weight end` line measured against what config.json puts on a GPU under each layout;
- mem_fraction_static: f = 1 - (post - reserve - #tokens x cell) / pre, rounded to the fewest
  decimals the lines' own rounding (0.01 GB) allows;
- cuda_graph_max_bs_decode: the largest batch of the decode graph capture line.

What the log states (server_args, or the operator's --logged-flag) is kept and checked against
the lines: a disagreement is named. A flag that matters and that neither states nor the lines
fix is `unknown`: the caller refuses the calibration and says how to give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang_fleet.capacity import attention_dp, kv_cache
from sglang_fleet.capacity.model_config import ModelShape
from sglang_fleet.capacity.server_log import StartupLog
from sglang_fleet.module_utils.typed_number import finite_or_none

# The flags a calibration's prediction depends on: without them it would describe another run.
MATTERS = ("tp_size", "attn_dp_size", "mem_fraction_static", "kv_cache_dtype")
# Flags the operator may state for the logged run (--logged-flag NAME=VALUE).
STATABLE = (*MATTERS, "dp_size", "page_size", "cuda_graph_max_bs_decode", "max_total_tokens")

# torch dtypes SGLang allocates the KV pool in, as --kv-cache-dtype names them ("auto" is the
# model's own 16-bit dtype). uint8 holds packed fp4: the cell size says which.
TORCH_KV_DTYPES = {
    "torch.bfloat16": "auto",
    "torch.float16": "auto",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}
# Weights per GPU measured against planned: one layout must be this close, and the next one
# at least twice as far (otherwise the weights do not tell the layouts apart).
WEIGHT_TOLERANCE = 0.05
# The `avail mem` and KV size figures are printed to 0.01 GB.
PRINTED_GIB = 0.005
# The tp sizes a layout is looked for among: GPUs come in nodes of 1, 2, 4 or 8, and tp spans
# whole nodes (a tp of 6 or 9 is possible but not guessed: state it with --logged-flag).
TP_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class LoggedRun:
    """The logged run's flags: value and where each came from ("stated", or a log line)."""

    flags: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    disagreements: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        """One line per flag: `tp_size 8 (from: [... TP5] Load weight end...)`."""
        return [f"{name} {self.flags[name]} ({self.sources[name]})" for name in self.flags]


def _tags(startup: StartupLog, kind: str) -> list[int]:
    return sorted(int(tag[2:]) for tag in startup.rank_tags if tag.startswith(kind))


def _same_dtype(a: Any, b: Any) -> bool:
    try:
        return kv_cache.elem_bytes(str(a)) == kv_cache.elem_bytes(str(b))
    except ValueError:
        return str(a) == str(b)


class _Inference:
    def __init__(
        self,
        startup: StartupLog,
        shape: ModelShape | None,
        weights: attention_dp.WeightLayout | None,
        stated: Mapping[str, Any],
    ):
        self.startup_log, self.shape, self.weights = startup, shape, weights
        self.stated = {k: v for k, v in stated.items() if v is not None}
        self.out = LoggedRun()

    def take(self, name: str, value: Any, source: str) -> None:
        """The stated value wins; the inferred one checks it."""
        if name in self.stated:
            given = self.stated[name]
            if value is not None and not self._agrees(name, given, value):
                self.out.disagreements.append(
                    f"{name}: stated {given}, but the log's lines say {value} ({source})"
                )
            value, source = given, "stated"
        if value is None:
            if name in MATTERS:
                self.out.unknown.append(name)
            return
        self.out.flags[name] = value
        self.out.sources[name] = source

    def _agrees(self, name: str, given: Any, value: Any) -> bool:
        if name == "kv_cache_dtype":
            return _same_dtype(given, value)
        a, b = finite_or_none(given), finite_or_none(value)
        if a is None or b is None:
            return str(given) == str(value)
        if name == "mem_fraction_static":
            return abs(a - b) <= max(self.fraction_uncertainty(), 0.001)
        return a == b

    def line(self, kind: str) -> str:
        return "from: " + self.startup_log.lines.get(kind, kind)

    # --- each flag --------------------------------------------------------------------
    def kv_dtype(self) -> None:
        dtype = TORCH_KV_DTYPES.get(self.startup_log.kv_torch_dtype or "")
        if dtype is None:  # uint8 (packed fp4) or a dtype not listed: the cell size says
            tp, attn = self.out.flags.get("tp_size"), self.out.flags.get("attn_dp_size")
            dtype = next(
                (d for d in ("auto", "fp8_e4m3", "fp4_e2m1") if self._cell_matches(d, tp, attn)),
                None,
            )
        self.take("kv_cache_dtype", dtype, self.line("kv_alloc"))

    def _cell(self, dtype: Any, tp: Any, attn: Any) -> int | None:
        """config.json's bytes per token for a dtype and layout (MHA: heads split over
        attention TP); None without config.json or for an unknown dtype."""
        if self.shape is None:
            return None
        attn_tp = int(finite_or_none(tp) or 1) // int(finite_or_none(attn) or 1)
        try:
            return kv_cache.cell_size_bytes(self.shape, str(dtype), max(1, attn_tp))
        except ValueError:
            return None

    def _cell_matches(self, dtype: Any, tp: Any, attn: Any) -> bool:
        """Whether the KV line's bytes per token are this dtype and layout's (within 2 % of
        the smaller of the two)."""
        measured, cell = self.cell_per_token(), self._cell(dtype, tp, attn)
        if measured is None or cell is None:
            return False
        return abs(cell - measured) <= 0.02 * min(cell, measured)

    def cell_per_token(self) -> float | None:
        """Bytes per token the KV line shows (its GB figure is rounded: None when too small)."""
        startup = self.startup_log
        if (
            not startup.kv_tokens
            or not startup.kv_size_gib
            or startup.kv_size_gib < 100 * PRINTED_GIB
        ):
            return None
        return startup.kv_size_gib * kv_cache.GIB / startup.kv_tokens

    def layout(self) -> None:
        tp_tags, dp_tags = _tags(self.startup_log, "TP"), _tags(self.startup_log, "DP")
        candidates = self._by_cell(self._layouts(tp_tags, dp_tags))
        picked, source = self._by_weights(candidates)
        if picked is None and self.startup_log.prefixed and not tp_tags and not dp_tags:
            # SGLang tags no rank at tp 1 without attention DP.
            picked, source = (1, 1), "from: no rank tag in the lines' prefix (tp 1)"
        if picked is None and len(candidates) == 1:
            tags = " ".join(sorted(self.startup_log.rank_tags))
            picked, source = candidates[0], f"from: the lines' rank tags ({tags})"
        tp, attn = picked if picked else (None, None)
        self.take("tp_size", tp, source)
        self.take("attn_dp_size", attn, source)

    def _layouts(self, tp_tags: list[int], dp_tags: list[int]) -> list[tuple[int, int]]:
        low_tp = tp_tags[-1] + 1 if tp_tags else 1
        out = []
        for tp in (size for size in TP_SIZES if size >= low_tp):
            if not tp_tags and self.startup_log.prefixed and tp > 1:
                break  # prefixed lines without a TP tag: tp 1
            for attn in attention_dp.attn_dp_sizes(tp):
                if dp_tags and attn <= dp_tags[-1]:
                    continue
                if not dp_tags and self.startup_log.prefixed and attn > 1:
                    continue  # attention DP tags every line with DP<d>
                out.append((tp, attn))
        return out

    def _by_cell(self, candidates: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The layouts whose cell size is the one the KV line shows; all of them when the
        line cannot tell."""
        dtype = TORCH_KV_DTYPES.get(self.startup_log.kv_torch_dtype or "")
        kept = [(tp, attn) for tp, attn in candidates if self._cell_matches(dtype, tp, attn)]
        return kept or candidates

    def _by_weights(self, candidates: list[tuple[int, int]]) -> tuple[Any, str]:
        measured = self.startup_log.weight_gib
        if self.weights is None or not measured or measured <= 0:
            return None, ""
        per_gpu = attention_dp.weights_per_gpu_bytes
        errors = sorted(
            (abs(per_gpu(self.weights, tp, attn) / kv_cache.GIB - measured) / measured, (tp, attn))
            for tp, attn in candidates
        )  # fmt: skip
        if not errors or errors[0][0] > WEIGHT_TOLERANCE:
            return None, ""
        if len(errors) > 1 and errors[1][0] < max(2 * errors[0][0], WEIGHT_TOLERANCE):
            return None, ""
        return errors[0][1], self.line("load_end") + f" ({measured:.2f} GiB of weights per GPU)"

    def fraction(self) -> None:
        startup = self.startup_log
        if startup.device == "cpu":
            # The CPU engine sizes its pool from host RAM or --max-total-tokens, not from the
            # fraction (docs/CPU-SERVERS.md): kept when stated, never inferred nor required.
            if "mem_fraction_static" in self.stated:
                self.take("mem_fraction_static", None, "stated")
            return
        value = None
        rest = self._kv_rest_gib()
        if rest is not None and startup.pre_gib and startup.post_gib is not None:
            reserve = self._reserve_gib()
            exact = 1 - (startup.post_gib - reserve - rest) / startup.pre_gib
            value = self._rounded(exact)
        self.take("mem_fraction_static", value, self.line("kv_alloc") + " and the avail mem lines")

    def _kv_rest_gib(self) -> float | None:
        """GiB the pool took: #tokens x the cell size config.json gives for the dtype and tp
        found (exact), else the KV line's rounded size."""
        startup = self.startup_log
        if not startup.kv_tokens:
            return None
        flags = self.out.flags
        dtype, tp = flags.get("kv_cache_dtype"), flags.get("tp_size")
        cell = self._cell(dtype, tp, flags.get("attn_dp_size")) if None not in (dtype, tp) else None
        if cell:
            # The pool is floored to whole tokens: half a cell more on average.
            return (startup.kv_tokens + 0.5) * cell / kv_cache.GIB
        return startup.kv_size_gib

    def _reserve_gib(self) -> float:
        if self.startup_log.multimodal_reserve_gib is not None:
            return self.startup_log.multimodal_reserve_gib
        return kv_cache.multimodal_reserve_gib(self.shape) if self.shape is not None else 0.0

    def fraction_uncertainty(self) -> float:
        pre = self.startup_log.pre_gib or 0.0
        return (2 * PRINTED_GIB) / pre if pre > 0 else 1.0

    def _rounded(self, exact: float) -> float:
        slack = self.fraction_uncertainty()
        for places in (2, 3):
            if abs(exact - round(exact, places)) <= slack:
                return round(exact, places)
        return round(exact, 4)

    def graph_bs(self) -> None:
        self.take(
            "cuda_graph_max_bs_decode", self.startup_log.decode_graph_max_bs, self.line("graph_end")
        )


def infer(
    startup: StartupLog,
    shape: ModelShape | None = None,
    weights: attention_dp.WeightLayout | None = None,
    stated: Mapping[str, Any] | None = None,
) -> LoggedRun:
    """The logged run's flags: stated ones (server_args, then `stated`) checked against the
    lines, the rest inferred from them. shape/weights (config.json) let the cell size and the
    weights per GPU speak; without them only the lines' own figures do."""
    given = dict(stated or {})
    for name in STATABLE:
        if name in startup.server_args and startup.server_args[name] is not None:
            given[name] = startup.server_args[name]
    if startup.server_args.get("enable_dp_attention") and "attn_dp_size" not in startup.server_args:
        given["attn_dp_size"], given["dp_size"] = given.get("dp_size") or 1, 1
    run = _Inference(startup, shape, weights, given)
    run.layout()
    run.kv_dtype()
    run.fraction()
    run.graph_bs()
    for name in ("dp_size", "page_size", "max_total_tokens"):
        if name in run.stated:
            run.take(name, None, "stated")
    return run.out
