"""STUB (see `torchvision.__doc__`): names import, any call raises."""

from torchvision._unavailable import module_getattr

__getattr__ = module_getattr("torchvision.io")
