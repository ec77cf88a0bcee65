"""Parse an SGLang server log: measured memory at start-up, and Decode batch samples.

Line formats are SGLang 0.5.23's (older forms where they differ are accepted too):

    [2026-11-29 10:00:00 TP0] Load weight begin. avail mem=94.21 GB
    [... TP0] Load weight end. elapsed=..., type=..., avail mem=24.05 GB, mem usage=70.16 GB.
    [... TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: N, KV size: X GB
    [... TP0] Memory pool end. avail mem=X GB
    [... TP0] Capture target decode CUDA graph end. bs=[...], elapsed=..., mem usage=...,
              avail mem=X GB.
              (<= 0.5.19: "Capture cuda graph end. Time elapsed: ... avail mem=X GB.")
    [...] max_total_num_tokens=N, chunked_prefill_size=N, ..., available_gpu_mem=X GB
              (CPU engine: "available_cpu_mem=X GB"; no pool-end or CUDA graph lines, and
              "avail mem" is host RAM per NUMA node: docs/CPU-SERVERS.md)
    [... TP0] KV Cache VA upper bound. ... / Post-capture KV sizing: ...
              (the KV pool is sized after graph capture: see `post_capture_kv_sizing`)
    [... TP0] Decode batch, #running-req: N, #token: N, token usage: 0.xx, cuda graph: True,
              gen throughput (token/s): X, #queue-req: N
              (speculative decoding: "accept len: 2.50, accept rate: 0.50, " before "cuda graph")

(`model_executor/model_runner.py`, `mem_cache/memory_pool.py`, `mem_cache/kv_cache_configurator.py`,
`model_executor/model_runner_components/cuda_graph_setup.py`, `managers/scheduler.py`,
`managers/scheduler_components/metrics_reporter.py`.) SGLang's "GB" here is GiB.
"""

from __future__ import annotations

import ast
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from sglang_fleet.module_utils import typed_number
from sglang_fleet.module_utils.typed_number import Range

_NUM = r"(\d+(?:\.\d+)?)"
# A line longer than this is skipped, and counted (StartupLog.long_lines): SGLang's longest,
# the server_args line, is about 19 KiB; the bound keeps what one line costs small.
MAX_LINE_CHARS = 64 * 1024
# "[2026-11-29 10:00:00 DP0 TP3] msg": the bracket's words after the time name the rank.
_PREFIX = re.compile(r"\[(?P<head>[^\]]*)\]\s*")
_RANK = re.compile(r"\b((?:DP|PP|TP|EP)\d+)\b")

# Every expression here is matched in time linear in the line's length. A line whose figures
# follow a head after other words ("Load weight end. elapsed=..., avail mem=...") is matched
# in two steps, the head and then what follows it (_head_then), never as one `head.*?tail`
# expression: with the head or the tail's pieces repeated, such an expression backtracks in
# time quadratic to cubic in the line's length (a line of 16 KiB held the parser for 20 s).
_LOAD_BEGIN = re.compile(rf"Load weight begin\. avail mem={_NUM} GB")
_LOAD_END = re.compile(r"Load weight end\.")
# "mem usage" is the drop in free memory across the load: on a CPU server (host RAM) or beside
# another process that frees memory meanwhile it can be negative ("mem usage=-0.01 GB", seen
# with SGLang 0.5.23's CPU engine while other work ran): the load used less than the noise.
_LOAD_END_MEMORY = re.compile(rf"avail mem={_NUM} GB, mem usage=(-?\d+(?:\.\d+)?) GB")
_LOAD_END_TYPE = re.compile(r"type=(\w+)")
_KV_ALLOC = re.compile(r"KV Cache is allocated\.")
_KV_DTYPE = re.compile(r"dtype: ([\w.]+),")
_KV_TOKENS = re.compile(
    rf"#tokens: (\d+), (?:KV size: {_NUM} GB|K size: {_NUM} GB, V size: {_NUM} GB)"
)
# SGLang keeps part of the KV budget back for a multimodal model's own pools (0.5.23).
_MM_RESERVE = re.compile(rf"Reserving {_NUM} GB of the KV budget")
_POOL_END = re.compile(rf"Memory pool end\. avail mem={_NUM} GB")
# "Capture <anything>graph end. ... avail mem=X GB", any case: what is left once captured.
_GRAPH = re.compile(r"Capture ", re.IGNORECASE)
_GRAPH_END = re.compile(r"graph end\.", re.IGNORECASE)
_GRAPH_AVAIL = re.compile(rf"avail mem={_NUM} GB", re.IGNORECASE)
# The decode graphs' batch sizes: the largest is --cuda-graph-max-bs(-decode) as SGLang resolved it.
_GRAPH_DECODE = re.compile(r"Capture (?:target )?decode ", re.IGNORECASE)
_GRAPH_BS = re.compile(r"graph end\. bs=\[([\d, ]+)\]", re.IGNORECASE)
_SCHED = re.compile(
    r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
    r"max_running_requests=(\d+), context_len=(\d+)"
    rf"(?:, available_(gpu|cpu)_mem={_NUM} GB)?"
)
# 0.5.23 sizes the KV pool after CUDA graph capture for some hybrid models (and only with
# SGLANG_ENABLE_POST_CAPTURE_KV_SIZING): its memory then follows another formula.
_POST_CAPTURE = re.compile(r"KV Cache VA upper bound|Post-capture KV sizing")
_DECODE = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (\d+), #token: (\d+), token usage: "
    rf"{_NUM}, "
)
_DECODE_SPEED = re.compile(rf"gen throughput \(token/s\): {_NUM}, #queue-req: (\d+)")
# With speculative decoding SGLang 0.5.23 writes, between the counts and the speed
# (scheduler_components/metrics_reporter.py): "accept len: 2.50, accept rate: 0.50, ".
_DECODE_ACCEPT = re.compile(rf"accept len: {_NUM}, accept rate: {_NUM}, ")
# server_args=ServerArgs(a=1, ...) up to 0.5.19; server_args={'a': 1, ...} from 0.5.20.
_ARG_NUM = r"['\"]?{name}['\"]?\s*[=:]\s*(-?\d+(?:\.\d+)?)"
_ARG_STR = r"['\"]?{name}['\"]?\s*[=:]\s*['\"]([^'\"]*)['\"]"


@dataclass(frozen=True)
class DecodeSample:
    """One "Decode batch" line."""

    rank: str
    num_running_reqs: int
    num_tokens: int
    token_usage: float
    gen_throughput: float
    num_queue_reqs: int
    # Speculative decoding's accepted tokens per verify and accepted share of the drafts.
    accept_length: float | None = None
    accept_rate: float | None = None


@dataclass
class StartupLog:
    """What a start-up log measured (GiB, minimum over ranks where ranks differ)."""

    pre_gib: float | None = None
    post_gib: float | None = None
    weight_gib: float | None = None
    kv_tokens: int | None = None
    kv_size_gib: float | None = None
    pool_end_avail_gib: float | None = None
    graph_end_avail_gib: float | None = None
    max_total_num_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    context_len: int | None = None
    # available_gpu_mem (available_cpu_mem on CPU) of the scheduler line: free on rank 0 once
    # start-up is done.
    startup_avail_gib: float | None = None
    # "cpu" when the log is the CPU engine's (available_cpu_mem, or server_args device), else
    # "cuda" once the scheduler line or server_args says so; None when the log does not say.
    device: str | None = None
    architecture: str | None = None
    post_capture_kv_sizing: bool = False
    # Every value of the server_args line that parses as a Python literal.
    server_args: dict[str, object] = field(default_factory=dict)
    mem_fraction_static: float | None = None
    kv_cache_dtype: str | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    model_path: str | None = None
    decode_samples: list[DecodeSample] = field(default_factory=list)
    # What the lines themselves show of the run (sglang_fleet.capacity.logged_flags infers its flags
    # from them): the KV pool's torch dtype, the largest decode graph batch, every rank tag
    # seen ("TP3", "DP1", "PP0"), whether the lines carry SGLang's "[time ranks]" prefix at
    # all, and the first line of each kind, to say where an inferred flag came from.
    kv_torch_dtype: str | None = None
    multimodal_reserve_gib: float | None = None
    decode_graph_max_bs: int | None = None
    rank_tags: set[str] = field(default_factory=set)
    prefixed: bool = False
    lines: dict[str, str] = field(default_factory=dict)
    # Lines longer than MAX_LINE_CHARS, skipped unread; memory or scheduler lines whose
    # figures are no numbers SGLang prints (400 digits, a count past 2**40), skipped.
    long_lines: int = 0
    unreadable_lines: int = 0
    # (kind, rank) of the lines _FIRST_PER_RANK already took.
    ranks_seen: set[tuple[str, str]] = field(default_factory=set)

    def long_lines_note(self) -> str | None:
        """What the parse skipped, in words, or None when it read every line."""
        parts = []
        if self.long_lines:
            parts.append(
                f"{self.long_lines} line(s) of the log are longer than "
                f"{MAX_LINE_CHARS // 1024} KiB and were not read (SGLang's longest, the "
                "server_args line, is about 19 KiB)."
            )
        if self.unreadable_lines:
            parts.append(
                f"{self.unreadable_lines} memory or scheduler line(s) hold figures no SGLang "
                "prints (out of range) and were not read."
            )
        return " ".join(parts) or None

    @property
    def has_memory(self) -> bool:
        """Enough start-up lines to replace the planner's memory estimates."""
        return self.pre_gib is not None and self.post_gib is not None

    def per_request_tok_s(self) -> float | None:
        """Median decode speed of one request: gen throughput / running requests."""
        speeds = [
            s.gen_throughput / s.num_running_reqs
            for s in self.decode_samples
            if s.num_running_reqs > 0 and s.gen_throughput > 0
        ]
        return statistics.median(speeds) if speeds else None

    def accept_length(self) -> float | None:
        """Median accept len of the speculative Decode batch lines; None without any."""
        found = [s.accept_length for s in self.decode_samples if s.accept_length is not None]
        return statistics.median(found) if found else None


def _split(line: str) -> tuple[str, str]:
    """(rank tags, message) of a line; ("", the line) when it has no "[time ranks]" prefix."""
    text = line.strip()
    match = _PREFIX.match(text)
    # A message is one line: one that holds a newline is not a prefixed line.
    if not match or "\n" in text[match.end() :]:
        return "", text
    return " ".join(_RANK.findall(match["head"])), text[match.end() :]


def _head_then(msg: str, head: re.Pattern[str], tail: re.Pattern[str]) -> re.Match[str] | None:
    """The tail of the first `head.*?tail` in msg (`.` not crossing a newline), found in
    linear time: the first head of a line leaves the most room after it, so when no tail
    follows it none follows a later head of that line either."""
    for part in msg.split("\n"):
        start = head.search(part)
        found = tail.search(part, start.end()) if start else None
        if found:
            return found
    return None


def _min(current: float | None, value: float) -> float:
    return value if current is None else min(current, value)


def _max(current: float | None, value: float) -> float:
    return value if current is None else max(current, value)


# A log's figures are read through the one reader of numbers (plugins/module_utils/typed_number.py):
# a 400-digit figure raised OverflowError and a 5,000-digit count ValueError out of parse_log.
# A line whose figure is out of these ranges is no line SGLang wrote: it is skipped whole.
_GIB = Range(-(1 << 20), 1 << 20)  # GB figures; negative: memory that rose during a load
_COUNT = Range(-1, 1 << 40, integer=True)  # -1: chunked prefill off


def _gib(text: str) -> float:
    return float(typed_number.read(text, "a GB figure", _GIB))


def _count(text: str) -> int:
    return int(typed_number.read(text, "a count", _COUNT))


def _server_args(startup: StartupLog, msg: str) -> None:
    def num(name: str) -> float | None:
        found = re.search(_ARG_NUM.format(name=name), msg)
        return typed_number.finite_or_none(found[1], _GIB) if found else None

    def text(name: str) -> str | None:
        found = re.search(_ARG_STR.format(name=name), msg)
        return found[1] if found else None

    startup.server_args = _literal_args(msg)
    startup.mem_fraction_static = num("mem_fraction_static")
    tp, dp = num("tp_size"), num("dp_size")
    startup.tp_size = int(tp) if tp is not None and tp == int(tp) else None
    startup.dp_size = int(dp) if dp is not None and dp == int(dp) else None
    startup.kv_cache_dtype = text("kv_cache_dtype")
    startup.model_path = text("model_path")
    device = text("device")
    if device is not None:
        startup.device = "cpu" if device == "cpu" else "cuda"


def _literal_args(msg: str) -> dict[str, object]:
    """The `server_args={...}` dict of 0.5.20+, when it is made of literals only."""
    start = msg.find("server_args={")
    if start < 0:
        return {}
    try:
        value = ast.literal_eval(msg[start + len("server_args=") :].strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return {}
    return dict(value) if isinstance(value, dict) else {}


# A line quoted as a figure's source is cut here (a graph line lists every batch size).
MAX_QUOTED_LINE = 200


# Lines a rank writes once for the target and again for a speculative draft worker (its weights
# load, and its own KV pool is allocated, after the target's: docs/SPECULATIVE.md): the target's,
# the first of each rank, are the start's; the draft's would read as the target's free memory
# before its weights and as its pool.
_FIRST_PER_RANK = ("load_begin", "kv_alloc")


def _memory_line(startup: StartupLog, msg: str, rank: str = "") -> bool:
    """Record a start-up memory line, and the first line of its kind; False when the line
    is none of them."""
    for kind, record in _MEMORY_LINES:
        if kind in _FIRST_PER_RANK and (kind, rank) in startup.ranks_seen:
            if record(StartupLog(), msg):  # the draft's line: known, not the start's figure
                return True
            continue
        if record(startup, msg):
            startup.lines.setdefault(kind, msg[:MAX_QUOTED_LINE])
            if kind in _FIRST_PER_RANK:
                startup.ranks_seen.add((kind, rank))
            return True
    return False


def _load_begin(startup: StartupLog, msg: str) -> bool:
    if m := _LOAD_BEGIN.search(msg):
        startup.pre_gib = _min(startup.pre_gib, _gib(m[1]))
    return m is not None


def _load_end(startup: StartupLog, msg: str) -> bool:
    if m := _head_then(msg, _LOAD_END, _LOAD_END_MEMORY):
        post, usage = _gib(m[1]), _gib(m[2])
        startup.post_gib = _min(startup.post_gib, post)
        # A negative usage is free memory that rose during the load (something else freed
        # memory meanwhile): it measures no weights, so the weights stay unknown.
        if usage >= 0:
            startup.weight_gib = _max(startup.weight_gib, usage)
        if kind := _head_then(msg, _LOAD_END, _LOAD_END_TYPE):
            startup.architecture = kind[1]
    return m is not None


def _kv_allocated(msg: str) -> tuple[str | None, re.Match[str]] | None:
    """(dtype or None, the #tokens match) of `KV Cache is allocated.(.*?dtype: X,)?.*?#tokens:
    ...`: the first dtype after the head that a #tokens clause follows, else none."""
    for part in msg.split("\n"):
        head = _KV_ALLOC.search(part)
        if head is None:
            continue
        dtype = _KV_DTYPE.search(part, head.end())
        if dtype and (tokens := _KV_TOKENS.search(part, dtype.end())):
            return dtype[1], tokens
        if tokens := _KV_TOKENS.search(part, head.end()):
            return None, tokens
    return None


def _kv_alloc(startup: StartupLog, msg: str) -> bool:
    found = _kv_allocated(msg)
    if found is not None:
        dtype, m = found
        tokens = _count(m[1])
        size = _gib(m[2]) if m[2] else _gib(m[3]) + _gib(m[4])
        startup.kv_torch_dtype = dtype or startup.kv_torch_dtype
        startup.kv_tokens = int(_min(startup.kv_tokens, tokens))
        startup.kv_size_gib = _min(startup.kv_size_gib, size)
    return found is not None


def _multimodal_reserve(startup: StartupLog, msg: str) -> bool:
    if m := _MM_RESERVE.search(msg):
        startup.multimodal_reserve_gib = _gib(m[1])
    return m is not None


def _pool_end(startup: StartupLog, msg: str) -> bool:
    if m := _POOL_END.search(msg):
        startup.pool_end_avail_gib = _min(startup.pool_end_avail_gib, _gib(m[1]))
    return m is not None


def _graph_avail(msg: str) -> re.Match[str] | None:
    """The `avail mem=X GB` of `Capture .*graph end[.].*?avail mem=X GB`: the first after the
    last "graph end." that such a figure follows (the greedy `.*`), in linear time."""
    for part in msg.split("\n"):
        head = _GRAPH.search(part)
        if head is None:
            continue
        figures = [m.start() for m in _GRAPH_AVAIL.finditer(part, head.end())]
        ends = [m.end() for m in _GRAPH_END.finditer(part, head.end())]
        ends = [end for end in ends if figures and end <= figures[-1]]
        if ends:
            return _GRAPH_AVAIL.search(part, ends[-1])
    return None


def _graph_batch_sizes(msg: str) -> re.Match[str] | None:
    """The last `graph end. bs=[...]` after the first `Capture (target )?decode ` of a line."""
    for part in msg.split("\n"):
        head = _GRAPH_DECODE.search(part)
        found = list(_GRAPH_BS.finditer(part, head.end())) if head else []
        if found:
            return found[-1]
    return None


def _graph_end(startup: StartupLog, msg: str) -> bool:
    if m := _graph_avail(msg):
        # Decode and prefill graphs are captured one after the other: the lowest figure is
        # what is left once every graph is resident.
        avail = _gib(m[1])
        bs = _graph_batch_sizes(msg)
        sizes = [_count(n) for n in bs[1].replace(" ", "").split(",") if n] if bs else []
        startup.graph_end_avail_gib = _min(startup.graph_end_avail_gib, avail)
        if sizes:
            startup.decode_graph_max_bs = max(sizes)
    return m is not None


_MEMORY_LINES = (
    ("load_begin", _load_begin),
    ("load_end", _load_end),
    ("kv_alloc", _kv_alloc),
    ("multimodal_reserve", _multimodal_reserve),
    ("pool_end", _pool_end),
    ("graph_end", _graph_end),
)


def _scheduler_line(startup: StartupLog, msg: str) -> bool:
    m = _SCHED.search(msg)
    if not m:
        return False
    figures = _count(m[1]), _count(m[2]), _count(m[4]), _count(m[5])
    avail = _gib(m[7]) if m[7] is not None else None
    startup.lines.setdefault("scheduler", msg[:MAX_QUOTED_LINE])
    (startup.max_total_num_tokens, startup.chunked_prefill_size, startup.max_running_requests,
     startup.context_len) = figures  # fmt: skip
    if avail is not None:
        startup.startup_avail_gib = avail
        startup.device = "cpu" if m[6] == "cpu" else startup.device or "cuda"
    return True


def _decode_batch(
    msg: str,
) -> tuple[re.Match[str], re.Match[str], re.Match[str] | None] | None:
    """The parts of a Decode batch line (counts, then speed, and speculation's accept figures
    between them when present), as _head_then finds them."""
    for part in msg.split("\n"):
        counts = _DECODE.search(part)
        speed = _DECODE_SPEED.search(part, counts.end()) if counts else None
        if counts and speed:
            accept = _DECODE_ACCEPT.search(part, counts.end(), speed.start())
            return counts, speed, accept
    return None


def parse_decode_line(line: str) -> DecodeSample | None:
    """A DecodeSample for one log line, or None when it is not a Decode batch line (or is
    longer than MAX_LINE_CHARS)."""
    if len(line) > MAX_LINE_CHARS:
        return None
    rank, msg = _split(line)
    found = _decode_batch(msg)
    if found is None:
        return None
    counts, speed, accept = found
    try:
        return DecodeSample(
            rank=rank,
            num_running_reqs=_count(counts[1]),
            num_tokens=_count(counts[2]),
            token_usage=_gib(counts[3]),
            gen_throughput=_gib(speed[1]),
            num_queue_reqs=_count(speed[2]),
            accept_length=_gib(accept[1]) if accept else None,
            accept_rate=_gib(accept[2]) if accept else None,
        )
    except typed_number.NumberError:
        return None


def parse_decode_lines(lines: Iterable[str]) -> list[DecodeSample]:
    return [s for s in map(parse_decode_line, lines) if s is not None]


def parse_log(text: str) -> StartupLog:
    """Parse a whole server log; a line longer than MAX_LINE_CHARS is skipped (counted in
    long_lines), and so is a memory or scheduler line whose figure is no number SGLang prints
    (counted in unreadable_lines)."""
    startup = StartupLog()
    for line in text.splitlines():
        if len(line) > MAX_LINE_CHARS:
            startup.long_lines += 1
            continue
        rank, msg = _split(line)
        if msg != line.strip():
            startup.prefixed = True
            startup.rank_tags.update(rank.split())
        if "server_args=" in msg:
            _server_args(startup, msg)
            continue
        try:
            if _memory_line(startup, msg, rank) or _scheduler_line(startup, msg):
                continue
        except typed_number.NumberError:
            startup.unreadable_lines += 1
            continue
        if _POST_CAPTURE.search(msg):
            startup.post_capture_kv_sizing = True
        elif sample := parse_decode_line(line):
            startup.decode_samples.append(sample)
    return startup
