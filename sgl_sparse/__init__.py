"""sgl-sparse: an SGLang attention backend with per-request sparse-decode policies."""

import os as _os

__version__ = "0.1.0"
BACKEND_NAME = "sgl_sparse"

# Installed, `kernels/` is the subpackage `sgl_sparse.kernels`. Imported straight
# from a source checkout (e.g. a server started in the repo root, where the
# working directory comes first on sys.path), the checkout root is added to this
# package's search path so that `sgl_sparse.kernels` resolves the same way.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "kernels")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "two_segment_decode.py")
):
    __path__.append(_root)  # noqa: F821 - the package's own __path__
