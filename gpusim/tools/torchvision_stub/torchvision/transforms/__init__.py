"""``torchvision.transforms`` stand-in with the real ``InterpolationMode`` values."""

from torchvision._placeholder import module_getattr
from torchvision.transforms import functional
from torchvision.transforms._modes import InterpolationMode

__all__ = ["InterpolationMode", "functional"]
__getattr__ = module_getattr(__name__)
