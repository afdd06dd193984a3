"""Stand-in for ``torchvision.transforms``.

``InterpolationMode`` is a real enum (SGLang uses its members as default
argument values at import time); every transform class raises
NotImplementedError when instantiated.
"""

from .._stub import make_stub, module_getattr
from . import functional, v2  # noqa: F401
from .functional import InterpolationMode  # noqa: F401

Compose = make_stub("transforms.Compose")
Normalize = make_stub("transforms.Normalize")
Resize = make_stub("transforms.Resize")
CenterCrop = make_stub("transforms.CenterCrop")
ToTensor = make_stub("transforms.ToTensor")
Lambda = make_stub("transforms.Lambda")

__getattr__ = module_getattr("transforms", {})
