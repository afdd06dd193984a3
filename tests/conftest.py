import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests import the package from the checkout only when it is not installed.
try:
    import sgl_sparse  # noqa: F401
except ImportError:
    sys.path.insert(0, ROOT)
