"""Stand-in for ``torchvision.transforms.functional``."""

from enum import Enum

from .._stub import make_stub, module_getattr


class InterpolationMode(Enum):
    """Same members and values as torchvision's ``InterpolationMode``."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


resize = make_stub("transforms.functional.resize")
normalize = make_stub("transforms.functional.normalize")
to_tensor = make_stub("transforms.functional.to_tensor")
pil_to_tensor = make_stub("transforms.functional.pil_to_tensor")
to_pil_image = make_stub("transforms.functional.to_pil_image")
center_crop = make_stub("transforms.functional.center_crop")
pad = make_stub("transforms.functional.pad")

__getattr__ = module_getattr("transforms.functional", {})
