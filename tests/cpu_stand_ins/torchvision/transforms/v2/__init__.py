"""Stand-in for ``torchvision.transforms.v2``."""

from ..._stub import module_getattr
from . import functional  # noqa: F401
from ..functional import InterpolationMode  # noqa: F401

__getattr__ = module_getattr("transforms.v2", {})
