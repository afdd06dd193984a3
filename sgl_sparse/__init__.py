"""sgl-sparse: an SGLang attention backend with per-request sparse-decode policies."""

__version__ = "0.1.0"
BACKEND_NAME = "sgl_sparse"
