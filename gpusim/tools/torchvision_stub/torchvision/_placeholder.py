"""Permissive placeholders for the torchvision stand-in.

SGLang imports torchvision names at module import time (model configs, multimodal processors)
even when it only parses flags. The real torchvision wheel pulls a CUDA torch, so the reference
environment puts this package on the path instead: any name resolves at import time, and using
one fails loudly, so nothing silently computes a wrong image.
"""

from __future__ import annotations

from typing import Any, NoReturn

_MESSAGE = (
    "torchvision stand-in: {name} is a placeholder (the SGLang reference environment only "
    "parses flags and runs the benchmark client; it has no image support)"
)


def fail(name: str) -> NoReturn:
    raise RuntimeError(_MESSAGE.format(name=name))


class _PlaceholderMeta(type):
    """Class attributes resolve to further placeholders (e.g. ``Mode.BICUBIC``)."""

    def __getattr__(cls, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{cls.__qualname__}.{attr}")


class Placeholder(metaclass=_PlaceholderMeta):
    """Constructible and subclassable, so module-level ``T.Compose([...])`` still imports."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args
        self._kwargs = kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        fail(type(self).__qualname__)


def placeholder(name: str) -> type[Placeholder]:
    """A new placeholder class named after the attribute it stands in for."""
    return _PlaceholderMeta(name, (Placeholder,), {"__qualname__": name})


def module_getattr(module_name: str) -> Any:
    """A module-level ``__getattr__`` (PEP 562) that hands out placeholders."""

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return placeholder(f"{module_name}.{attr}")

    return __getattr__
