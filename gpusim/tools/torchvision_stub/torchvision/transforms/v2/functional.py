"""``torchvision.transforms.v2.functional`` stand-in."""

from torchvision._placeholder import module_getattr

__getattr__ = module_getattr(__name__)
