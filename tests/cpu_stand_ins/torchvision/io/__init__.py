"""Stand-in for ``torchvision.io``: every function raises NotImplementedError."""

from .._stub import make_stub, module_getattr

decode_jpeg = make_stub("io.decode_jpeg")
decode_image = make_stub("io.decode_image")
read_image = make_stub("io.read_image")
read_video = make_stub("io.read_video")
VideoReader = make_stub("io.VideoReader")

__getattr__ = module_getattr("io", {})
