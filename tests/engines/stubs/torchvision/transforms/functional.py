"""STUB (see `torchvision.__doc__`): names import, any call raises.

`InterpolationMode` is a real enum because SGLang uses its members as default argument
values, which are evaluated when its modules are imported."""

from enum import Enum

from torchvision._unavailable import module_getattr


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = module_getattr("torchvision.transforms.functional")
