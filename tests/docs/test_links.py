"""Every relative link in README.md and docs/ resolves to a file inside the repository, and every
``#anchor`` to a heading: a reader with a clone and nothing else can follow them all."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.docs.markdown import ROOT, anchors, doc_files, links

FILES = doc_files()


def _broken(doc: Path, text: str | None = None) -> list[str]:
    """What is wrong with each link of ``doc`` (whose text is ``text``, read from disk if None)."""
    text = doc.read_text() if text is None else text
    problems = []
    for target in links(text):
        parts = urlsplit(target)
        if parts.scheme in ("http", "https", "mailto"):
            continue
        if parts.scheme or parts.netloc:
            problems.append(f"{target}: only relative links and http(s) URLs")
            continue
        path = unquote(parts.path)
        if path.startswith("/"):
            problems.append(f"{target}: absolute path; link relative to {doc.name}")
            continue
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.is_relative_to(ROOT):
            problems.append(f"{target}: outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{target}: no such file")
            continue
        if parts.fragment:
            if resolved.suffix != ".md":
                problems.append(f"{target}: an anchor into a file that is not Markdown")
            elif parts.fragment not in anchors(resolved.read_text()):
                problems.append(f"{target}: no heading with anchor #{parts.fragment} in {resolved.name}")
    return problems


PAGES = ("api", "api-items", "cache", "client", "metrics", "vllm", "epd-proxy", "epd-families", "models", "operations",
         "robustness", "benchmarks", "benchmark-history", "development")


def test_the_docs_exist() -> None:
    names = {f.relative_to(ROOT).as_posix() for f in FILES}
    assert {"README.md", *(f"docs/{p}.md" for p in PAGES)} <= names


def test_every_page_leads_back_to_the_readme() -> None:
    """Each page stands alone, and a reader who landed on it from a search finds the map."""
    for doc in FILES:
        if doc.name != "README.md":
            assert "../README.md" in {urlsplit(t).path for t in links(doc.read_text())}, doc.name


@pytest.mark.parametrize("doc", FILES, ids=[f.relative_to(ROOT).as_posix() for f in FILES])
def test_every_relative_link_resolves(doc: Path) -> None:
    assert _broken(doc) == []


def test_readme_links_every_doc() -> None:
    readme_targets = {urlsplit(t).path for t in links((ROOT / "README.md").read_text())}
    docs = {f.relative_to(ROOT).as_posix() for f in FILES if f.name != "README.md"}
    assert docs - readme_targets == set()


def test_the_checker_finds_what_is_broken() -> None:
    """The checker itself: it must reject what a reader could not follow, and ignore code."""
    text = (
        "[a](../../shared/DESIGN.md) [b](missing.md) [c](api.md#no-such-heading) [d](/etc/passwd) "
        "[ok](api.md) [ok2](https://example.com) [ok3](../README.md#encode-server) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n[ref]: nowhere.md\n"
    )
    problems = _broken(ROOT / "docs" / "probe.md", text)
    assert [p.split(":")[0] for p in problems] == [
        "../../shared/DESIGN.md", "missing.md", "api.md#no-such-heading", "/etc/passwd", "nowhere.md",
    ]


_REPO_PATH = re.compile(r"`((?:encode_server|clients|deploy|tests|scripts|bench|docs)/[\w./-]*\w)`")


@pytest.mark.parametrize("doc", FILES, ids=[f.relative_to(ROOT).as_posix() for f in FILES])
def test_every_repository_path_named_in_code_exists(doc: Path) -> None:
    """A file named in the prose (`encode_server/api/grpc.py`, `deploy/k8s/`) is where it says."""
    named = set(_REPO_PATH.findall(doc.read_text()))
    assert sorted(p for p in named if not (ROOT / p).exists()) == []
