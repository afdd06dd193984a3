"""Entry point SGLang loads from the `sglang.srt.plugins` group.

Kept outside the `sgl_sparse` package on purpose: SGLang's plugin loader logs and
swallows import errors, after which `--attention-backend sgl_sparse` only fails as
an "invalid choice". This module imports the package itself and, when the server
was asked for sgl_sparse, stops start-up with the real reason instead.
"""

from __future__ import annotations

import logging
import os
import sys

_BACKEND = "sgl_sparse"


def _requested() -> bool:
    # Scheduler processes inherit the resolved config through the environment.
    return _BACKEND in sys.argv or any(a.endswith("=" + _BACKEND) for a in sys.argv) or (
        "SGLSPARSE_CONFIG_JSON" in os.environ
    )


def _explain(err: BaseException) -> str:
    import importlib.util

    spec = importlib.util.find_spec("sgl_sparse")
    where = list(spec.submodule_search_locations or []) if spec else []
    hint = ""
    if spec is not None and spec.origin in (None, "namespace"):
        hint = (
            f" 'sgl_sparse' resolves to {where}, a directory without the package's "
            "__init__.py: a folder named 'sgl_sparse' in the working directory or on "
            "PYTHONPATH shadows the installed package. Start the server from another "
            "directory or rename that folder."
        )
    return f"sgl_sparse plugin failed to load: {type(err).__name__}: {err}.{hint}"


def load() -> None:
    try:
        from sgl_sparse import plugin
    except Exception as err:  # noqa: BLE001 - reported, never swallowed
        msg = _explain(err)
        if _requested():
            # SystemExit passes through SGLang's `except Exception` in load_plugins.
            raise SystemExit(msg) from err
        logging.getLogger("sgl_sparse").error(msg)
        return
    plugin.register()
