"""Writing a benchmark's result: the JSON every benchmark command leaves behind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` (parents made) and say where; nothing when no path was asked for."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
