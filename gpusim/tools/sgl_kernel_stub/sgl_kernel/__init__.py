"""TEST INFRASTRUCTURE: import stand-in for ``sgl_kernel`` in the CPU-only SGLang 0.5.23 env.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports ``sgl_kernel.copy_all_layer_kv_cache_cpu`` at
start-up (``sglang/kernels/ops/kvcache/cache_move.py``), and PyPI has no CPU build of
sgl-kernel. On a CPU without Intel AMX SGLang runs a Llama on plain PyTorch paths and calls no
sgl_kernel op, so an importable package is all it needs. Every public attribute of this package
is a function that raises ``NotImplementedError`` naming the op: if SGLang ever does call one,
the server fails loudly instead of computing something wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+stand-in"


class StandInOpCalled(NotImplementedError):
    """An sgl_kernel op was called; the stand-in has none."""


def _op(name: str) -> Callable[..., NoReturn]:
    def op(*args: Any, **kwargs: Any) -> NoReturn:
        raise StandInOpCalled(
            f"sgl_kernel stand-in: op {name!r} was called, but this environment has no "
            "sgl_kernel build (gpusim/tools/sgl_kernel_stub, test infrastructure only)"
        )

    op.__name__ = op.__qualname__ = name
    op.__module__ = "sgl_kernel"
    return op


def __getattr__(name: str) -> Callable[..., NoReturn]:
    # Dunder lookups (``__path__``, ``__file__``, pickling, inspect) must behave like a normal
    # module, otherwise importlib and hasattr() probes break.
    if name.startswith("__"):
        raise AttributeError(name)
    return _op(f"sgl_kernel.{name}")
