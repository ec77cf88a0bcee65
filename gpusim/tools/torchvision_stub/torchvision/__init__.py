"""Stand-in for torchvision in the GPU-less SGLang reference environment (see _placeholder)."""

from torchvision import io, transforms
from torchvision._placeholder import module_getattr

__version__ = "0.0.0+stand-in"
__all__ = ["io", "transforms"]
__getattr__ = module_getattr(__name__)
