"""README's flag table lists every server flag and nothing else, and the limits of docs/api.md
name real flags and their real environment variables."""

from __future__ import annotations

import re

from encode_server.config import ENV_PREFIX, build_parser
from tests.docs.markdown import ROOT, tables

FLAGS = {opt for action in build_parser()._actions for opt in action.option_strings if opt.startswith("--")} - {
    "--help"
}


def _table(path: str, header: list[str]) -> list[list[str]]:
    found = [t for t in tables((ROOT / path).read_text()) if t[0][: len(header)] == header]
    assert len(found) == 1, f"{path}: one table with the header {header}"
    return found[0][1:]


def test_readme_lists_every_flag() -> None:
    rows = _table("README.md", ["flag", "default", "what"])
    listed = {flag for row in rows for flag in re.findall(r"`(--[a-z-]+)`", row[0])}
    assert sorted(FLAGS - listed) == [], "flags missing from README's table"
    assert sorted(listed - FLAGS) == [], "README lists flags the server does not have"


def test_the_limits_name_real_flags_and_variables() -> None:
    rows = _table("docs/api.md", ["flag (env)", "default"])
    assert rows
    for row in rows:
        for flag, env in re.findall(r"`(--[a-z-]+)` \(`([A-Z_]+)`\)", row[0]):
            assert flag in FLAGS, flag
            assert env == ENV_PREFIX + flag[2:].replace("-", "_").upper()
    named = {f for row in rows for f in re.findall(r"`(--[a-z-]+)`", row[0])}
    assert {"--max-request-bytes", "--max-items", "--max-image-pixels", "--max-queue", "--request-timeout"} <= named
