"""Stand-in for ``torchvision.transforms.v2.functional``."""

from ..._stub import module_getattr
from ..functional import (  # noqa: F401
    InterpolationMode,
    center_crop,
    normalize,
    pad,
    resize,
    to_pil_image,
)

__getattr__ = module_getattr("transforms.v2.functional", {})
