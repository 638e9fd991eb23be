"""Just enough Markdown for the doc tests: links, headings and their GitHub anchors, tables."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROOT", "CodeBlock", "anchors", "code_blocks", "doc_files", "links", "prose", "tables"]

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans: a link inside code is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target: inline ``[x](target)``, reference definitions, HTML href/src."""
    body = prose(text)
    return [*_INLINE_LINK.findall(body), *_REFERENCE_DEF.findall(body), *_HTML_LINK.findall(body)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation removed, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes for the headings of ``text`` (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, heading in _HEADING.findall(_FENCE.sub("", text)):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def tables(text: str) -> list[list[list[str]]]:
    """Every pipe table outside code blocks, as rows of stripped cells (header first, the
    ``---`` separator row dropped)."""
    out: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*_FENCE.sub("", text).splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", stripped.strip("|"))]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                current.append(cells)
        elif current:
            out.append(current)
            current = []
    return out


@dataclass(frozen=True)
class CodeBlock:
    language: str  # the fence's info string ("bash", "python", "" when none)
    heading: str  # the heading the block is under ("" above the first)
    body: str  # its lines, without the fences

    @property
    def first_line(self) -> str:
        return self.body.splitlines()[0] if self.body else ""


_BLOCK = re.compile(r"^(```|~~~)([^\n]*)\n(.*?)^\1[^\n]*$", re.MULTILINE | re.DOTALL)


def code_blocks(text: str) -> list[CodeBlock]:
    """Every fenced code block, in order, with the heading above it."""
    out = []
    for m in _BLOCK.finditer(text):
        headings = _HEADING.findall(_FENCE.sub("", text[: m.start()]))
        out.append(CodeBlock(m.group(2).strip(), headings[-1][1] if headings else "", m.group(3).rstrip("\n")))
    return out
