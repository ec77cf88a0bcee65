"""The scheduler loop: KV-bound admission, batched decode, SGLang's batch log lines.

Model (see README "Throughput model"):
- A request is admitted only when its whole KV footprint (prompt + max_new_tokens) fits in
  what is left of max_total_num_tokens and fewer than max_running_requests run; the rest
  wait in FIFO order. The double allocates that footprint at admission, so #token and
  token usage count reserved slots.
- A prefill step takes prefill_token_s per uncached prompt token and emits each new
  request's first token. A decode step emits one token for every running request and takes
  decode_step_s * (1 + batch_slowdown * (batch - 1)): per-request speed falls with batch
  size while the batch's total throughput rises.
- Finished prompts stay in a prefix cache (64-token blocks) as large as the device pool
  plus any HiCache host pool: a hit skips prefill work, it never adds decode slots.
- version_slowdown (hardware.yaml `sglang_version_slowdown`, the installed SGLang's factor)
  multiplies both the decode step and the per-token prefill time: a version that regresses.
- Speculative decoding (gpusim/speculative.py SpecDecode): a decode step is a verify of
  batch x draft tokens rows plus the draft's forwards, and gives each request accept_length
  tokens on average; the decode line carries SGLang's `accept len` and `accept rate`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpusim.logs import METRICS_REPORTER
from gpusim.memory import MemoryPlan, prefill_oom_message
from gpusim.speculative import SpecDecode
from gpusim.state import Timing

logger = METRICS_REPORTER  # SGLang logs batch lines from its metrics reporter
PREFIX_BLOCK = 64


@dataclass
class Request:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    input_ids: list[int] | None = None
    stream: bool = False
    created: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    generated: int = 0
    finished: bool = False
    aborted: bool = False
    error: str | None = None
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    # Speculative decoding: accepted tokens owed but not yet whole (a fractional accept
    # length is paid out as whole tokens, on average exactly the accept length).
    spec_credit: float = 0.0

    @property
    def footprint(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def finish_reason(self) -> dict[str, object]:
        if self.aborted:
            return {"type": "abort", "message": self.error or "aborted"}
        return {"type": "length", "length": self.max_new_tokens}


@dataclass
class Stats:
    """Counters and samples the HTTP layer turns into /metrics."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    cached_tokens_total: int = 0
    gen_throughput: float = 0.0
    peak_running: int = 0
    peak_queue: int = 0
    peak_token_usage: float = 0.0


@dataclass
class SpecStats:
    """What SGLang's metrics reporter publishes for speculation at each decode log interval
    (`report_decode_stats`): the interval's mean accept length and rate, and the active
    steps/draft tokens. All 0 until the first decode line, as on the real server."""

    accept_length: float = 0.0
    accept_rate: float = 0.0
    num_steps: int = 0
    num_draft_tokens: int = 0


class PrefixCache:
    """LRU of chained 64-token block hashes: a radix cache reduced to what it saves."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = max(0, capacity_tokens // PREFIX_BLOCK)
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    @staticmethod
    def _chain(input_ids: list[int]) -> list[int]:
        hashes, running = [], 0
        for start in range(0, len(input_ids) - PREFIX_BLOCK + 1, PREFIX_BLOCK):
            running = hash((running, tuple(input_ids[start : start + PREFIX_BLOCK])))
            hashes.append(running)
        return hashes

    def match(self, input_ids: list[int]) -> int:
        matched = 0
        for block in self._chain(input_ids):
            if block not in self.blocks:
                break
            self.blocks.move_to_end(block)
            matched += PREFIX_BLOCK
        # SGLang always recomputes at least the last prompt token.
        return min(matched, max(0, len(input_ids) - 1))

    def insert(self, input_ids: list[int]) -> None:
        for block in self._chain(input_ids):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


class Scheduler:
    """One TP group's scheduling, run as an asyncio task in the launcher."""

    def __init__(
        self,
        plan: MemoryPlan,
        timing: Timing,
        *,
        decode_log_interval: int = 40,
        radix_cache: bool = True,
        on_crash: Callable[[str], None] | None = None,
        realtime: bool = True,
        log_prefix: str | None = None,
        step_factor: float = 1.0,
        version_slowdown: float = 1.0,
        spec: SpecDecode | None = None,
    ) -> None:
        self.plan = plan
        self.spec = spec
        self.spec_stats = SpecStats()
        # Per decode-log interval, as metrics_reporter.py: accepted tokens and request-steps.
        self._spec_accept_tokens = 0
        self._spec_forward_ct = 0
        # An attention-DP rank's lines carry its own prefix (" DP1 TP2"); None: the default.
        self._log_extra = {} if log_prefix is None else {"extra": {"prefix": log_prefix}}
        self.step_factor = step_factor
        # The installed SGLang version's regression factor (README, "Versions"); 1.0: none.
        self.version_slowdown = version_slowdown
        self.timing = timing
        self.decode_log_interval = max(1, decode_log_interval)
        self.max_total = plan.max_total_num_tokens
        self.max_running = plan.max_running_requests
        self.chunk = plan.chunked_prefill_size if plan.chunked_prefill_size > 0 else 1 << 30
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.reserved = 0
        self.stats = Stats()
        self.prefix_cache = PrefixCache(plan.max_total_num_tokens + plan.host_pool_tokens)
        self.radix_cache = radix_cache
        self.on_crash = on_crash
        self.wakeup = asyncio.Event()
        self.forward_ct_decode = 0
        self._tokens_since_log = 0
        self._last_decode_log = time.perf_counter()
        self._last_prefill_log = time.perf_counter()
        self.crashed = False
        self.last_progress = 0.0
        # Simulated seconds spent in forward passes: throughput comparisons use this clock,
        # so they hold however fast or loaded the machine running the double is.
        self.sim_time = 0.0
        self.realtime = realtime

    # -- public API used by the HTTP layer ---------------------------------------------------
    def submit(self, req: Request) -> None:
        self.stats.num_requests_total += 1
        self.waiting.append(req)
        self.wakeup.set()

    def abort(self, req: Request) -> None:
        """Client went away: drop it from the queue or free its slots."""
        if req.finished:
            return
        req.aborted, req.finished = True, True
        self.stats.num_aborted_requests_total += 1
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.running:
            self.running.remove(req)
            self.reserved -= req.footprint
        req.progress.set()

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- simulated durations -----------------------------------------------------------------
    def decode_step_seconds(self, batch: int) -> float:
        """One decode step of `batch` running requests (with speculation: one draft-and-verify
        step, SpecDecode.step_factor)."""
        slowdown = self.timing.batch_slowdown
        if self.spec is not None:
            factor = self.spec.step_factor(batch, slowdown)
        else:
            factor = 1 + slowdown * (batch - 1)
        return self.timing.decode_step_s * self.step_factor * self.version_slowdown * factor

    def prefill_seconds(self, new_tokens: int) -> float:
        """One prefill batch of `new_tokens` uncached prompt tokens (a draft model prefills
        them too: its extend costs its share of a target forward)."""
        draft = self.spec.draft_cost if self.spec is not None else 0.0
        return self.timing.prefill_token_s * self.version_slowdown * new_tokens * (1 + draft)

    @property
    def token_usage(self) -> float:
        return self.reserved / self.max_total if self.max_total else 0.0

    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            return False
        self.prefix_cache.clear()
        return True

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        while not self.crashed:
            if not self.waiting and not self.running:
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            admitted = self._admit()
            if admitted:
                await self._prefill(admitted)
            elif self.running:
                await self._decode_step()
            else:
                # Queue head cannot fit even in an empty pool: SGLang would reject it.
                self._reject_oversized()

    def _reject_oversized(self) -> None:
        req = self.waiting.popleft()
        req.error = f"Requested token count exceeds the KV pool: {req.footprint} > {self.max_total}"
        req.aborted, req.finished = True, True
        self.stats.num_aborted_requests_total += 1
        req.progress.set()

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        new_tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            req = self.waiting[0]
            if self.reserved + req.footprint > self.max_total:
                break
            cached = self._match_prefix(req)
            if admitted and new_tokens + req.prompt_tokens - cached > self.chunk:
                break  # the rest goes into the next prefill batch
            self.waiting.popleft()
            req.cached_tokens = cached
            req.admitted = time.perf_counter()
            self.reserved += req.footprint
            new_tokens += req.prompt_tokens - cached
            admitted.append(req)
        return admitted

    def _match_prefix(self, req: Request) -> int:
        if not self.radix_cache or not req.input_ids:
            return 0
        return self.prefix_cache.match(req.input_ids)

    async def _prefill(self, batch: list[Request]) -> None:
        new_tokens = sum(r.prompt_tokens - r.cached_tokens for r in batch)
        cached = sum(r.cached_tokens for r in batch)
        # Chunked prefill bounds one forward's activations by chunked_prefill_size.
        oom = prefill_oom_message(self.plan, min(new_tokens, self.chunk))
        if oom is not None:
            self.crashed = True
            if self.on_crash is not None:
                self.on_crash(oom)
            return
        self.running.extend(batch)
        self.stats.prompt_tokens_total += new_tokens + cached
        self.stats.cached_tokens_total += cached
        if logger.isEnabledFor(logging.INFO):
            self._log_prefill(len(batch), new_tokens, cached)
        await self._sleep(self.prefill_seconds(new_tokens))
        now = time.perf_counter()
        for req in batch:
            if req.finished:
                continue
            if req.max_new_tokens <= 0:
                req.finished, req.finished_at = True, now
                req.progress.set()
            else:
                self._emit(req, now)
        self._reap()

    async def _decode_step(self) -> None:
        batch = len(self.running)
        await self._sleep(self.decode_step_seconds(batch))
        now = time.perf_counter()
        produced = 0
        for req in self.running:
            produced += self._emit(req, now, self._accepted(req))
        self._tokens_since_log += produced
        if self.spec is not None:
            self._spec_accept_tokens += produced
            self._spec_forward_ct += batch
        self.forward_ct_decode += 1
        if self.forward_ct_decode % self.decode_log_interval == 0:
            self._log_decode()
        self._reap()

    def _accepted(self, req: Request) -> int:
        """Tokens this decode step gives the request: 1, or with speculation the accept
        length paid out in whole tokens (at least the bonus token)."""
        if self.spec is None:
            return 1
        req.spec_credit += self.spec.accept_length
        tokens = max(1, int(req.spec_credit))
        req.spec_credit -= tokens
        return tokens

    def _emit(self, req: Request, now: float, count: int = 1) -> int:
        """Give the request up to `count` tokens (never past max_new_tokens); how many."""
        count = max(0, min(count, req.max_new_tokens - req.generated))
        req.generated += count
        self.stats.generation_tokens_total += count
        self.last_progress = now
        if req.first_token_at is None:
            req.first_token_at = now
        req.last_token_at = now
        if req.generated >= req.max_new_tokens:
            req.finished = True
            req.finished_at = now
        req.progress.set()
        return count

    def _reap(self) -> None:
        done = [r for r in self.running if r.finished]
        if not done:
            self._track_peaks()
            return
        self.running = [r for r in self.running if not r.finished]
        for req in done:
            self.reserved -= req.footprint
            if self.radix_cache and req.input_ids and not req.aborted:
                self.prefix_cache.insert(req.input_ids)
        self._track_peaks()

    def _track_peaks(self) -> None:
        s = self.stats
        s.peak_running = max(s.peak_running, len(self.running))
        s.peak_queue = max(s.peak_queue, len(self.waiting))
        s.peak_token_usage = max(s.peak_token_usage, self.token_usage)

    async def _sleep(self, seconds: float) -> None:
        self.sim_time += seconds
        # Always yield, so HTTP handlers stream even when simulated time is zero.
        await asyncio.sleep(seconds if self.realtime and seconds > 0 else 0)

    # -- SGLang's log lines ----------------------------------------------------------------
    def _log_prefill(self, new_seqs: int, new_tokens: int, cached: int) -> None:
        now = time.perf_counter()
        gap = now - self._last_prefill_log
        self._last_prefill_log = now
        throughput = new_tokens / gap if gap > 0 else 0.0
        logger.info(
            f"Prefill batch, #new-seq: {new_seqs}, #new-token: {new_tokens}, "
            f"#cached-token: {cached}, token usage: {self.token_usage:.2f}, "
            f"#running-req: {len(self.running) - new_seqs}, #queue-req: {len(self.waiting)}, "
            f"#pending-token: 0, cuda graph: False, input throughput (token/s): {throughput:.2f}",
            **self._log_extra,
        )

    def _log_decode(self) -> None:
        now = time.perf_counter()
        gap = now - self._last_decode_log
        self._last_decode_log = now
        self.stats.gen_throughput = self._tokens_since_log / gap if gap > 0 else 0.0
        self._tokens_since_log = 0
        cuda_graph = len(self.running) <= self.plan.decode_graph_max_bs
        logger.info(
            f"Decode batch, #running-req: {len(self.running)}, #token: {self.reserved}, "
            f"token usage: {self.token_usage:.2f}, {self._spec_log_part()}"
            f"cuda graph: {cuda_graph}, "
            f"gen throughput (token/s): {self.stats.gen_throughput:.2f}, "
            f"#queue-req: {len(self.waiting)}",
            **self._log_extra,
        )

    def _spec_log_part(self) -> str:
        """`report_decode_stats`' speculative part: the interval's mean accept length
        (accepted tokens per request-step, the bonus token included) and rate (accepted drafts
        over drafts proposed, draft tokens - 1 per request-step); the counters then restart.
        Empty without speculation."""
        if self.spec is None:
            return ""
        forwards = self._spec_forward_ct
        length = self._spec_accept_tokens / forwards if forwards else 0.0
        drafts = forwards * (self.spec.num_draft_tokens - 1)
        correct = self._spec_accept_tokens - forwards  # one token per step is not a draft's
        rate = correct / drafts if drafts > 0 else 0.0
        self._spec_accept_tokens = self._spec_forward_ct = 0
        self.spec_stats = SpecStats(length, rate, self.spec.num_steps, self.spec.num_draft_tokens)
        return f"accept len: {length:.2f}, accept rate: {rate:.2f}, "


class AttentionDPSchedulers:
    """Attention data parallelism: one Scheduler, KV pool and queue per attention-DP rank
    (README, "Attention DP"), behind the one-scheduler interface the HTTP layer uses.

    Requests go to the ranks round-robin (SGLang's data-parallel controller; its other
    load-balance methods are not modelled). Each rank steps on its own with its own batch;
    the lockstep of the MoE layers across ranks is not modelled (see README).
    """

    def __init__(self, ranks: list[Scheduler], leaders: list[int]) -> None:
        self.ranks = ranks
        # The global TP rank of each attention-DP rank's first GPU (metrics label it so).
        self.leaders = leaders
        self.plan = ranks[0].plan
        self.on_crash = ranks[0].on_crash
        # The ranks start together: the first one's start-up phases stand for the server's.
        self.timing = ranks[0].timing
        self._next = 0

    def submit(self, req: Request) -> None:
        rank = self.ranks[self._next % len(self.ranks)]
        self._next += 1
        rank.submit(req)

    def abort(self, req: Request) -> None:
        for rank in self.ranks:
            if req in rank.waiting or req in rank.running:
                rank.abort(req)
                return
        if not req.finished:
            req.aborted, req.finished = True, True
            req.progress.set()

    async def run(self) -> None:
        await asyncio.gather(*(rank.run() for rank in self.ranks))

    def flush_cache(self) -> bool:
        if any(rank.running or rank.waiting for rank in self.ranks):
            return False
        return all(rank.flush_cache() for rank in self.ranks)

    @property
    def running(self) -> list[Request]:
        return [req for rank in self.ranks for req in rank.running]

    @property
    def waiting(self) -> list[Request]:
        return [req for rank in self.ranks for req in rank.waiting]

    @property
    def in_flight(self) -> int:
        return sum(rank.in_flight for rank in self.ranks)

    @property
    def reserved(self) -> int:
        return sum(rank.reserved for rank in self.ranks)

    @property
    def max_total(self) -> int:
        return sum(rank.max_total for rank in self.ranks)

    @property
    def token_usage(self) -> float:
        return self.reserved / self.max_total if self.max_total else 0.0

    @property
    def prefix_cache(self) -> PrefixCache:
        """Rank 0's prefix cache: the cached-blocks gauge is scheduler 0's, as in SGLang."""
        return self.ranks[0].prefix_cache

    @property
    def crashed(self) -> bool:
        return any(rank.crashed for rank in self.ranks)

    @crashed.setter
    def crashed(self, value: bool) -> None:
        for rank in self.ranks:
            rank.crashed = value

    @property
    def last_progress(self) -> float:
        return max(rank.last_progress for rank in self.ranks)

    @property
    def forward_ct_decode(self) -> int:
        return sum(rank.forward_ct_decode for rank in self.ranks)

    @property
    def sim_time(self) -> float:
        return max(rank.sim_time for rank in self.ranks)

    @property
    def spec_stats(self) -> SpecStats:
        """Rank 0's published speculation figures (each rank reports its own in SGLang)."""
        return self.ranks[0].spec_stats

    @property
    def stats(self) -> Stats:
        """The server's totals (counters summed, peaks of the busiest rank)."""
        total = Stats()
        for rank in self.ranks:
            for name, value in vars(rank.stats).items():
                if name.startswith("peak_"):
                    setattr(total, name, max(getattr(total, name), value))
                else:
                    setattr(total, name, getattr(total, name) + value)
        return total
