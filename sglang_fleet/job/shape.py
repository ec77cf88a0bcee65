"""A job's shape: the (prompt tokens, output tokens) of its calls, sampled, for the smoke gate
and autotune to run the job's own lengths instead of fixed ones (docs/JOB.md, "Gate and tune
on the job").

    python -m sglang_fleet.job shape OUT.jsonl       # measured: what the servers counted
    python -m sglang_fleet.job shape IN.jsonl --max-tokens 2048     # estimated from the text

Measured lengths come from the job's ledger: each row's calls keep the server's usage counts
(ledger.Entry.usage), so a job that ran a while says exactly what its requests look like. Before
any row ran, the input is read instead: a prompt's tokens are estimated at four characters a
token (an estimate, said as one: the server's tokenizer decides), and each call asks for the
job's max_tokens. The sample is drawn with a fixed seed: the same source gives the same shape,
so the relative gate compares runs of one shape (the smoke result keeps its digest).
"""

from __future__ import annotations

import math
import random
from typing import Any

from sglang_fleet.job import ledger as ledger_mod
from sglang_fleet.job import rows
from sglang_fleet.smoke.smoke_client.workload import MAX_LENGTH_PAIRS, MAX_TOKENS_PER_REQUEST

CHARS_PER_TOKEN = 4
DEFAULT_SAMPLE = 256
SEED = 45


def measured(output: str) -> list[tuple[int, int]] | None:
    """Every call's lengths the job's ledger holds; None without a ledger beside `output`."""
    pairs = ledger_mod.read_usage(output)
    return None if pairs is None else [p for p in pairs if p[0] > 0 and p[1] > 0]


def estimated(index: rows.InputIndex, max_tokens: int) -> list[tuple[int, int]]:
    """Each call a row would make, its prompt estimated from the text (CHARS_PER_TOKEN), its
    output the tokens it asks for. A conversation's earlier answers count max_tokens each."""
    pairs: list[tuple[int, int]] = []
    for line in index.lines:
        if line.skip is not None:
            continue
        row = rows.read_row(index.path, line)
        if line.kind == "batch":
            body = row["body"]
            asked = body.get("max_completion_tokens", body.get("max_tokens"))
            asked = asked if isinstance(asked, int) and asked > 0 else max_tokens
            pairs.append((_tokens(body.get("messages", body.get("prompt"))), asked))
            continue
        prompt = 0
        for turn in row["conversations"]:
            if turn["role"] == "assistant":
                continue
            prompt += _tokens(turn["content"])
            if turn["role"] == "user":
                pairs.append((prompt, max_tokens))
                prompt += max_tokens  # the answer joins the next turn's prompt
    return pairs


def _tokens(value: Any) -> int:
    text = value if isinstance(value, str) else repr(value)
    return max(1, min(MAX_TOKENS_PER_REQUEST, math.ceil(len(text) / CHARS_PER_TOKEN)))


def sample(pairs: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """At most `size` pairs (and MAX_LENGTH_PAIRS), drawn with a fixed seed, in a fixed order."""
    size = min(size, MAX_LENGTH_PAIRS)
    capped = [(min(p, MAX_TOKENS_PER_REQUEST), min(c, MAX_TOKENS_PER_REQUEST)) for p, c in pairs]
    if len(capped) <= size:
        return capped
    return random.Random(SEED).sample(capped, size)


def describe(pairs: list[tuple[int, int]], source: str) -> dict[str, Any]:
    count = len(pairs)
    return {
        "source": source,
        "pairs": count,
        "mean_prompt_tokens": round(sum(p for p, _c in pairs) / count) if count else None,
        "mean_output_tokens": round(sum(c for _p, c in pairs) / count) if count else None,
    }
