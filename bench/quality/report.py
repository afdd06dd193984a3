"""Where eval.py and fidelity.py put their results: stdout, and optionally JSON + markdown files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def emit(res: dict[str, Any], md: str, out_json: Optional[str], out_md: Optional[str]) -> None:
    print(md)
    if out_json:
        Path(out_json).write_text(json.dumps(res, indent=2) + "\n")
    if out_md:
        Path(out_md).write_text(md)
