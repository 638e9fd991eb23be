"""``encode-server``: parse the flags into one ``Settings``, set up logging, and hand over to the
composition root (``encode_server.app``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from encode_server.app import run
from encode_server.auth import ApiKeys
from encode_server.config import settings_from
from encode_server.logs import configure_logging
from encode_server.malloc import tune_allocator

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(sys.argv[1:] if argv is None else argv, os.environ)
    configure_logging(settings.log_level, settings.log_format)
    tune_allocator()  # before any thread starts: arenas are made per thread
    try:
        ApiKeys.from_settings(settings)  # refused here, in one line; the server says what it serves once up
    except ValueError as exc:
        raise SystemExit(f"--api-key/--api-keys: {exc}") from None
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
