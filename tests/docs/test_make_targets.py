"""Every ``make TARGET`` the docs, the README and the tests' own docstrings name is a target of the
Makefile: a renamed target leaves no instruction behind that fails (``tests/conftest.py`` once sent
readers to a test-gpu-path target, which never existed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`make ([a-z][a-z0-9-]*)")


def _targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_every_make_target_named_in_backquotes_exists() -> None:
    targets = _targets()
    assert {"test", "test-quick", "gpu-rehearsal"} <= targets
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "tests").rglob("*.py")]
    missing = {f"{page.relative_to(ROOT)}: make {name}" for page in pages
               for name in NAMED.findall(page.read_text()) if name not in targets}
    assert missing == set(), sorted(missing)
