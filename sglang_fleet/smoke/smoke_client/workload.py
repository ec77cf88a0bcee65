"""What to run: the configuration, the request bodies (a fixed seed gives the same
workload on every run), the vocabulary size of the model served (random token ids stay
below it) and the workload's limits."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import stat
from collections.abc import Iterable, Iterator
from typing import Any

from sglang_fleet.smoke.smoke_client import server_json

# Token ids drawn for random prompts start above the ids tokenizers reserve for special tokens
# and stay below the model's vocabulary size (package docstring).
_FIRST_TOKEN_ID = 100
_MODEL_FILE_LIMIT_BYTES = 64 * 1024 * 1024
_WORDS = (  # noqa: SIM905 (a paragraph reads better than a hundred one-word lines)
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "up out who them some could more into only time other than then about two may first any new "
    "very these like well over such after most also made many before must through back years "
    "where much your way down should because each just those people how too little state good"
).split()
# Limits on the workload, far above any real one, so a typo fails here, not as a MemoryError.
MAX_TOKENS_PER_REQUEST = 1 << 21
# A job's shape (--lengths): at most this many (prompt, output) pairs, taken in turn.
MAX_LENGTH_PAIRS = 4096


class VocabularyUnknown(Exception):
    """The model's vocabulary size cannot be found (exit status 2: pass --vocab-size)."""


@dataclasses.dataclass
class Config:
    """What to run, resolved from the command line (see ``command_line.build_parser`` for
    meanings)."""

    url: str
    backend: str = "sglang"
    num_prompts: int | None = 1000
    duration: float | None = None
    max_concurrency: int | None = None
    request_rate: float = math.inf
    random_input_len: int = 1024
    random_output_len: int = 128
    seed: int = 42
    warmup_requests: int = 1
    api_key: str | None = None
    model: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    metrics_interval: float = 0.5
    timeout: float = 600.0
    vocab_size: int | None = None
    # A job's shape: (prompt tokens, output tokens) of each request in turn, instead of the
    # fixed random_input_len/random_output_len (docs/JOB.md, "Gate and tune on the job").
    lengths: tuple[tuple[int, int], ...] | None = None

    def pairs(self) -> tuple[tuple[int, int], ...]:
        return self.lengths or ((self.random_input_len, self.random_output_len),)


def parse_lengths(text: str) -> tuple[tuple[int, int], ...]:
    """`I:O,I:O,...` as (prompt tokens, output tokens) pairs (what `python -m sglang_fleet.job
    shape` prints); ValueError saying what is wrong. Read in one linear pass, every count a
    plain number from 1 to MAX_TOKENS_PER_REQUEST, at most MAX_LENGTH_PAIRS pairs."""
    words = text.strip().split(",")
    if len(words) > MAX_LENGTH_PAIRS:
        raise ValueError(f"{len(words)} pairs, more than {MAX_LENGTH_PAIRS}")
    pairs = []
    for number, word in enumerate(words, start=1):
        prompt, sep, output = word.strip().partition(":")
        counts = (prompt, output)
        if not sep or not all(c.isdigit() and c.isascii() and len(c) <= 8 for c in counts):
            raise ValueError(f"pair {number} ({word.strip()[:40]!r}) is not PROMPT:OUTPUT")
        pair = (int(prompt), int(output))
        if not all(1 <= c <= MAX_TOKENS_PER_REQUEST for c in pair):
            raise ValueError(f"pair {number}: counts go from 1 to {MAX_TOKENS_PER_REQUEST}")
        pairs.append(pair)
    return tuple(pairs)


def format_lengths(pairs: Iterable[tuple[int, int]]) -> str:
    return ",".join(f"{prompt}:{output}" for prompt, output in pairs)


def lengths_digest(pairs: tuple[tuple[int, int], ...]) -> str:
    """A shape's identity in a result: two runs of one shape compare (the relative gate)."""
    return hashlib.sha256(format_lengths(pairs).encode()).hexdigest()[:16]


def token_ids(vocab_size: int) -> range:
    """The ids random prompts are drawn from: below vocab_size, above the special tokens."""
    return range(min(_FIRST_TOKEN_ID, vocab_size // 4), vocab_size)


def _generate_body(
    cfg: Config, rng: random.Random, model: str, ids_from: range, lengths: tuple[int, int]
) -> bytes:
    """One request body of `lengths` (prompt, output tokens); a fixed seed gives the same
    workload on every run."""
    input_len, output_len = lengths
    if cfg.backend == "sglang":
        ids = rng.choices(ids_from, k=input_len)
        payload: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": output_len,
                "ignore_eos": True,
                "temperature": 0,
            },
            "stream": True,
        }
    else:
        # Common words are about one token each; the server's usage gives the exact count.
        words = [rng.choice(_WORDS) for _word in range(input_len)]
        payload = {
            "model": model,
            "prompt": " ".join(words),
            "max_tokens": output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return json.dumps(payload, separators=(",", ":")).encode()


def request_bodies(
    cfg: Config, seed: int, model: str, count: int | None, ids_from: range
) -> Iterator[tuple[bytes, int]]:
    """(request body, output tokens it asks for) in a fixed order, the shape's pairs in turn;
    endless when ``count`` is None (duration mode)."""
    rng = random.Random(seed)
    pairs = cfg.pairs()
    sent = 0
    while count is None or sent < count:
        lengths = pairs[sent % len(pairs)]
        yield _generate_body(cfg, rng, model, ids_from, lengths), lengths[1]
        sent += 1


def _read_json_file(path: str) -> Any:
    """A model file as JSON, or None when it is absent, unreadable, too big or not JSON."""
    try:
        # Without blocking, then only a regular file: a FIFO or a device never holds the run.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = handle.read(_MODEL_FILE_LIMIT_BYTES + 1)
        return server_json.loads(data) if len(data) <= _MODEL_FILE_LIMIT_BYTES else None
    except (OSError, ValueError):
        return None


def _config_vocab(config: Any) -> int | None:
    """config.json's vocab_size (a multimodal wrapper keeps it in text_config)."""
    if not isinstance(config, dict):
        return None
    for holder in (config, config.get("text_config")):
        if isinstance(holder, dict):
            size = holder.get("vocab_size")
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                return size
    return None


def _tokenizer_vocab(tokenizer: Any) -> int | None:
    """One past the highest id tokenizer.json knows (its model's vocab and added tokens)."""
    if not isinstance(tokenizer, dict):
        return None
    ids: list[int] = []
    vocab = (
        (tokenizer.get("model") or {}).get("vocab")
        if isinstance(tokenizer.get("model"), dict)
        else None
    )
    if isinstance(vocab, dict):
        ids += [v for v in vocab.values() if isinstance(v, int)]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
        ids.append(len(vocab) - 1)
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            ids.append(token["id"])
    return max(ids) + 1 if ids else None


def vocab_size_of(directory: str) -> int | None:
    """The vocabulary size of a model directory on this host: the smaller of config.json's
    vocab_size and tokenizer.json's ids (a token id must be valid for both), or None."""
    sizes = [
        _config_vocab(_read_json_file(os.path.join(directory, "config.json"))),
        _tokenizer_vocab(_read_json_file(os.path.join(directory, "tokenizer.json"))),
    ]
    known = [size for size in sizes if size]
    return min(known) if known else None
