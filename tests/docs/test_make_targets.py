"""Every ``make TARGET`` the docs, the README and the tests' own docstrings name is a target of the
Makefile: a renamed target leaves no instruction behind that fails (``tests/conftest.py`` once sent
readers to a test-gpu-path target, which never existed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


def test_make_install_keeps_setuptools_editable_notice_out_of_its_output(tmp_path: Path) -> None:
    """``make serve`` printed setuptools' "Editable installation." notice twice (one per editable
    package, through pip even with --quiet): the Makefile's filter must match what setuptools says."""
    found = re.search(r'^EDITABLE_QUIET := PYTHONWARNINGS="([^"]+)"$', (ROOT / "Makefile").read_text(), re.M)
    assert found, "the install recipe's warning filter is gone"
    install = re.search(r"^\t(.*pip install --quiet -e '\.\[dev\]'.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert install and install.group(1).startswith("$(EDITABLE_QUIET) "), "the pip install runs without the filter"
    build = [sys.executable, "-c", "import sys, setuptools.build_meta as b; b.build_editable(sys.argv[1])",
             str(tmp_path)]

    def notice(warnings: str | None) -> bool:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env.update({"PYTHONWARNINGS": warnings} if warnings else {})
        done = subprocess.run(build, cwd=ROOT / "clients" / "python", env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return "Editable installation" in done.stderr

    assert notice(None), "setuptools no longer says it: the filter can go"
    assert not notice(found.group(1))


def test_the_readme_says_where_b3sum_comes_from_where_it_first_uses_it() -> None:
    """``make serve`` does not install b3sum (only ``make tools`` does, for the tests): the README's
    first use of it says how to get it, and gives what the venv already has instead."""
    first = next(line for line in (ROOT / "README.md").read_text().splitlines() if "b3sum" in line)
    assert "apt-get install b3sum" in first, first
    alternative = re.search(r"H=\$\((\.venv/bin/encode-client hash cat\.png \| cut -d' ' -f1)\)", first)
    assert alternative, first
