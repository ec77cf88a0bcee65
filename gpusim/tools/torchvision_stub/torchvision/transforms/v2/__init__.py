"""``torchvision.transforms.v2`` stand-in."""

from torchvision._placeholder import module_getattr
from torchvision.transforms._modes import InterpolationMode
from torchvision.transforms.v2 import functional

__all__ = ["InterpolationMode", "functional"]
__getattr__ = module_getattr(__name__)
