"""The Kimi job's fixtures (docs/THE-JOB.md): its start-up log at 0.85 bf16 tp 8, its GPU, and
the flag set that log came from. Shared by the calibration, autotune and tuning-filter tests."""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KIMI_LOG = (FIXTURES / "logs" / "constructed-kimi-k2.5-tp8-mf085-bf16.log").read_text()
GPU = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
# The flags of the run KIMI_LOG records.
KIMI_RUN_FLAGS = {
    "tp_size": 8,
    "mem_fraction_static": 0.85,
    "kv_cache_dtype": "auto",
    "chunked_prefill_size": 8192,
    "num_continuous_decode_steps": 4,
    "disable_custom_all_reduce": True,
}
