"""``encode-server``: parse the flags into one ``Settings``, set up logging, and hand over to the
composition root (``encode_server.app``)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from encode_server.app import run
from encode_server.auth import ApiKeys
from encode_server.config import settings_from
from encode_server.logs import configure_logging
from encode_server.malloc import tune_allocator

__all__ = ["main"]

log = logging.getLogger("encode_server")


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(sys.argv[1:] if argv is None else argv, os.environ)
    configure_logging(settings.log_level, settings.log_format)
    tune_allocator()  # before any thread starts: arenas are made per thread
    try:
        keys = ApiKeys.from_settings(settings)
    except ValueError as exc:
        raise SystemExit(f"--api-key/--api-keys: {exc}") from None
    if keys is None:
        log.info("no API keys configured: /v1/* is open")
        if settings.tenant_isolation:
            log.warning("--tenant-isolation without API keys: every request is in the default tenant")
    else:
        log.info("%d API key(s), tenant isolation %s", len(keys), "on" if settings.tenant_isolation else "off")
    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
