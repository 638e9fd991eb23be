"""``bench/results/latest.json``: one file of every bench's keys, each bench replacing its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "merge_into"]

RESULTS = Path(__file__).parent / "results"


def merge_into(out: Path, result: dict[str, Any]) -> None:
    """``result``'s keys written into ``out`` (created if missing), every other key kept."""
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged.update(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2) + "\n")
