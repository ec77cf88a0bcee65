"""``torchvision.transforms.functional`` stand-in."""

from torchvision._placeholder import module_getattr
from torchvision.transforms._modes import InterpolationMode

__all__ = ["InterpolationMode"]
__getattr__ = module_getattr(__name__)
