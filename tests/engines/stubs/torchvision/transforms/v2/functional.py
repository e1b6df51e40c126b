"""STUB (see `torchvision.__doc__`): names import, any call raises."""

from torchvision._unavailable import module_getattr
from torchvision.transforms.functional import InterpolationMode

__all__ = ["InterpolationMode"]
__getattr__ = module_getattr("torchvision.transforms.v2.functional")
