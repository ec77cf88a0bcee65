"""What to run: the configuration, the request bodies (a fixed seed gives the same
workload on every run), the vocabulary size of the model served (random token ids stay
below it) and the workload's limits."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import stat
from collections.abc import Iterator
from typing import Any

from sglang_fleet.bench.smoke_client import server_json

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


def token_ids(vocab_size: int) -> range:
    """The ids random prompts are drawn from: below vocab_size, above the special tokens."""
    return range(min(_FIRST_TOKEN_ID, vocab_size // 4), vocab_size)


def _generate_body(cfg: Config, rng: random.Random, model: str, ids_from: range) -> bytes:
    """One request body; a fixed seed gives the same workload on every run."""
    if cfg.backend == "sglang":
        ids = rng.choices(ids_from, k=cfg.random_input_len)
        payload: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": cfg.random_output_len,
                "ignore_eos": True,
                "temperature": 0,
            },
            "stream": True,
        }
    else:
        # Common words are about one token each; the server's usage gives the exact count.
        words = [rng.choice(_WORDS) for _ in range(cfg.random_input_len)]
        payload = {
            "model": model,
            "prompt": " ".join(words),
            "max_tokens": cfg.random_output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    return json.dumps(payload, separators=(",", ":")).encode()


def request_bodies(
    cfg: Config, seed: int, model: str, count: int | None, ids_from: range
) -> Iterator[bytes]:
    """Request bodies in a fixed order; endless when ``count`` is None (duration mode)."""
    rng = random.Random(seed)
    sent = 0
    while count is None or sent < count:
        yield _generate_body(cfg, rng, model, ids_from)
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
