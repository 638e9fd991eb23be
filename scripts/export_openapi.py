"""Write the HTTP API's OpenAPI document to ``docs/openapi.json``: the one way it is made
(``make openapi``).

The document comes from the app factory itself, so it is exactly what a running server serves at
``/openapi.json``; ``tests/docs/test_openapi.py`` compares the file with a real server's and fails
when it is stale. ``--check`` compares without writing (exit 1 and a diff when they differ).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "openapi.json"


def build_app() -> Any:
    """The HTTP app, built as the composition root (``encode_server/app.py``) builds it, but with no
    service: the document depends on neither the model nor the settings. The one place that knows
    the app factory's signature."""
    from encode_server.api.http import create_app
    from encode_server.api.runtime import Runtime
    from encode_server.config import Settings
    from encode_server.metrics import Metrics

    return create_app(Runtime(Settings(), Metrics()))


def render(document: dict[str, Any]) -> str:
    """Stable text: two-space indent, keys in the app's order, a final newline."""
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render(build_app().openapi())
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current == text:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(args.output), "app")
        )
        print(f"{args.output} is stale: run `make openapi`", file=sys.stderr)
        return 1
    args.output.write_text(text)
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
