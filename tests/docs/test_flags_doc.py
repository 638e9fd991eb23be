"""The flag table of docs/operations.md is what ``make docs`` writes from the settings object, so it
lists every server flag exactly once and cannot drift from ``encode-server --help``; no other page
restates a flag's default; the limits of docs/api.md name real flags and their real variables."""

from __future__ import annotations

import re

from encode_server.config import ENV_PREFIX, build_parser
from scripts.gen_docs import BEGIN, END, render, render_flags
from tests.docs.markdown import ROOT, doc_files, tables

# One flag per setting; a switch's negation (``--no-redis-cluster``) is named in its flag's row.
FLAGS = {action.option_strings[0] for action in build_parser()._actions} - {"-h"}
NEGATIONS = {
    action.option_strings[0]: action.option_strings[1]
    for action in build_parser()._actions if len(action.option_strings) == 2 and action.option_strings[0] != "-h"
}
OPERATIONS = ROOT / "docs" / "operations.md"


def _table(path: str, header: list[str]) -> list[list[str]]:
    found = [t for t in tables((ROOT / path).read_text()) if t[0][: len(header)] == header]
    assert len(found) == 1, f"{path}: one table with the header {header}"
    return found[0][1:]


def test_the_flag_table_is_what_make_docs_writes() -> None:
    page = OPERATIONS.read_text()
    assert render(page) == page, "docs/operations.md's flag table is stale: run `make docs`"


def test_the_flag_table_lists_every_flag_exactly_once() -> None:
    rows = _table("docs/operations.md", ["flag", "environment variable", "default", "what"])
    listed = [flag for row in rows for flag in re.findall(r"^`(--[a-z-]+)`$", row[0])]
    assert len(listed) == len(rows), "one flag per row"
    assert sorted(listed) == sorted(FLAGS), "the table and the parser disagree"
    assert len(set(listed)) == len(listed), "a flag listed twice"
    for row, flag in zip(rows, listed, strict=True):
        assert row[1] == f"`{ENV_PREFIX}{flag[2:].replace('-', '_').upper()}`", row
        if flag in NEGATIONS:
            assert f"`{NEGATIONS[flag]}`" in row[3], row
    assert {"--redis-cluster", "--tenant-isolation"} <= set(NEGATIONS)


def test_the_table_carries_the_help_text() -> None:
    """What ``--help`` says for a flag is what the table says (the generator's own input)."""
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings[0] in FLAGS}
    table = render_flags()
    for flag, text in helps.items():
        what = (text or "").rsplit(" (default: ", 1)[0].replace("|", "\\|").replace("<", "&lt;")
        assert f"| `{flag}` |" in table and what in table, flag


def test_no_other_table_restates_a_default() -> None:
    """A flag's default is written once, in the generated table: any other table that lists flags
    has no default column, so a changed default cannot leave a stale copy behind."""
    for doc in doc_files():
        text = doc.read_text()
        if doc == OPERATIONS:
            head, _, rest = text.partition(BEGIN)
            text = head + rest.partition(END)[2]
        for table in tables(text):
            names_flags = any(re.match(r"`--[a-z-]+`", row[0]) for row in table[1:])
            if names_flags:
                assert "default" not in [c.lower() for c in table[0]], f"{doc.name}: {table[0]}"


def test_the_generator_rejects_a_page_without_markers() -> None:
    try:
        render("# a page\n| flag | default |\n")
    except SystemExit as exc:
        assert "markers" in str(exc)
    else:
        raise AssertionError("a page without markers was accepted")


def test_the_limits_name_real_flags_and_variables() -> None:
    rows = _table("docs/api.md", ["flag (env)", "applies to", "past it"])
    assert rows
    for row in rows:
        for flag, env in re.findall(r"`(--[a-z-]+)` \(`([A-Z_]+)`\)", row[0]):
            assert flag in FLAGS, flag
            assert env == ENV_PREFIX + flag[2:].replace("-", "_").upper()
    named = {f for row in rows for f in re.findall(r"`(--[a-z-]+)`", row[0])}
    assert {"--max-request-bytes", "--max-items", "--max-image-pixels", "--max-queue", "--request-timeout"} <= named


def test_the_proxy_page_lists_every_proxy_flag_and_its_variable() -> None:
    """docs/epd-proxy.md's table of encode-epd-proxy's flags is the proxy's command line, no more, no less."""
    import inspect

    from encode_client import proxy

    flags = {o for a in proxy.build_parser()._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
    rows = _table("docs/epd-proxy.md", ["flag (env)", "what"])
    listed = {flag for row in rows for flag in re.findall(r"`(--[a-z-]+)`", row[0])}
    assert listed == flags
    source = inspect.getsource(proxy.build_parser)
    defaults = {a.option_strings[0]: a.default for a in proxy.build_parser()._actions}
    for row in rows:
        for env in re.findall(r"`([A-Z][A-Z_]+)`", row[0]):
            assert f'os.environ.get("{env}")' in source, env
        flag = re.findall(r"`(--[a-z-]+)`", row[0])[0]
        default = defaults[flag]
        plain = isinstance(default, (str, float, int)) and not isinstance(default, bool)
        if plain and flag not in ("--api-key", "--api-keys", "--vllm-api-key"):
            assert f"(default `{default}`)" in row[1], (flag, default)
        elif isinstance(default, tuple):
            assert f"(default `{default[0]}:{default[1]}`)" in row[1], (flag, default)
