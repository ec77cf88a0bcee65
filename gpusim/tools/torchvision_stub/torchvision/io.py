"""``torchvision.io`` stand-in: SGLang imports ``decode_jpeg`` lazily for image requests."""

from typing import Any, NoReturn

from torchvision._placeholder import fail, module_getattr


def decode_jpeg(*args: Any, **kwargs: Any) -> NoReturn:
    fail("torchvision.io.decode_jpeg")


__getattr__ = module_getattr(__name__)
