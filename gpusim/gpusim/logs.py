"""SGLang 0.5.23's loggers and logging set-up, so a deployment's logging config acts alike.

Every line the double logs goes through the logger SGLang logs it with (the module's
`__name__` in the 0.5.23 wheel), so a `logging.config.dictConfig` file written for real
SGLang (`SGLANG_LOGGING_CONFIG_PATH`) silences or routes the same lines here, e.g. the
`server_args=` line that carries `--api-key`. `configure` is `srt/utils/common.py`
`configure_logger`: the file, when set, replaces the whole default set-up (format, level,
handlers); otherwise `[%(asctime)s TP0] %(message)s` on stderr at `--log-level`.

The loggers are created at import, before `configure` runs, as in SGLang's processes: a
config that leaves `disable_existing_loggers` at its default (true) therefore silences every
SGLang logger it does not name (or name a parent of), here as there.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys

# Launcher (SGLang's main process).
ENGINE = logging.getLogger("sglang.srt.entrypoints.engine")  # server_args=, sigquit
HTTP_SERVER = logging.getLogger("sglang.srt.entrypoints.http_server")  # fired up and ready
TOKENIZER_MANAGER = logging.getLogger("sglang.srt.managers.tokenizer_manager")  # SIGTERM, drain
UVICORN_ERROR = logging.getLogger("uvicorn.error")  # "error while attempting to bind"
COMMON_UTILS = logging.getLogger("sglang.srt.utils.common")  # dummy health server (node >= 1)
# Flag resolution (launcher, before server_args=): the reset to 48 and the other warnings.
SPECULATIVE_HOOK = logging.getLogger("sglang.srt.arg_groups.speculative_hook")
# Scheduler processes (one per TP rank): their lines carry the rank prefix (" TP0").
BOOTSTRAP = logging.getLogger("sglang.srt.distributed.bootstrap")  # Init parallel begin/ends
MODEL_RUNNER = logging.getLogger("sglang.srt.model_executor.model_runner")  # Load weight
MEMORY_POOL = logging.getLogger("sglang.srt.mem_cache.memory_pool")  # KV Cache is allocated
KV_CACHE_CONFIGURATOR = logging.getLogger(
    "sglang.srt.mem_cache.kv_cache_configurator"
)  # Memory pool end, multimodal reserve
CUDA_GRAPH_SETUP = logging.getLogger(
    "sglang.srt.model_executor.model_runner_components.cuda_graph_setup"
)  # Capture target decode/prefill CUDA graph begin/end
SCHEDULER = logging.getLogger("sglang.srt.managers.scheduler")  # max_total_num_tokens=, crash
METRICS_REPORTER = logging.getLogger(
    "sglang.srt.managers.scheduler_components.metrics_reporter"
)  # Prefill batch / Decode batch
HOST_POOL = logging.getLogger("sglang.srt.mem_cache.pool_host.base")  # HiCache host pool
SCHEDULER_SIDE = (
    BOOTSTRAP,
    MODEL_RUNNER,
    MEMORY_POOL,
    KV_CACHE_CONFIGURATOR,
    CUDA_GRAPH_SETUP,
    SCHEDULER,
    METRICS_REPORTER,
    HOST_POOL,
)
CONFIG_ENV = "SGLANG_LOGGING_CONFIG_PATH"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class LoggingConfigMissing(Exception):
    """SGLang raises a bare Exception when SGLANG_LOGGING_CONFIG_PATH names no file."""


class PrefixFormatter(logging.Formatter):
    """SGLang's default format; the rank prefix rides on the record (none: launcher line)."""

    def format(self, record: logging.LogRecord) -> str:
        if not hasattr(record, "prefix"):
            record.prefix = ""
        return super().format(record)


def _default_format() -> str:
    # SGLANG_LOG_MS adds milliseconds to the time, as in configure_logger.
    millis = os.environ.get("SGLANG_LOG_MS", "").lower() in ("1", "true", "yes")
    return "[%(asctime)s" + (".%(msecs)03d" if millis else "") + "%(prefix)s] %(message)s"


def configure(level: str, rank_prefix: str) -> None:
    """`configure_logger`: the JSON dictConfig from SGLANG_LOGGING_CONFIG_PATH, else the default.

    Raises LoggingConfigMissing (SGLang's message) when the variable names no file.
    """
    config_path = os.environ.get(CONFIG_ENV)
    if config_path:
        if not os.path.exists(config_path):
            raise LoggingConfigMissing(
                f"Setting {CONFIG_ENV} from env with {config_path} but it does not exist!"
            )
        with open(config_path, encoding="utf-8") as handle:
            logging.config.dictConfig(json.load(handle))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PrefixFormatter(_default_format(), DATE_FORMAT))
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(getattr(logging, level.upper(), logging.INFO))
    _prefix_scheduler_lines(rank_prefix)


def _prefix_scheduler_lines(rank_prefix: str) -> None:
    """Scheduler-side lines without a per-rank prefix speak as the first local rank."""

    def add_prefix(record: logging.LogRecord) -> bool:
        if not hasattr(record, "prefix"):
            record.prefix = rank_prefix
        return True

    for logger in SCHEDULER_SIDE:
        logger.filters[:] = [add_prefix]
