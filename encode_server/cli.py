"""``encode-server``: build the settings once, load the model behind the HTTP server, serve."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from functools import partial

import uvicorn

from encode_server.api.http import Runtime, create_app
from encode_server.config import Settings, settings_from
from encode_server.encoders import load_encoder
from encode_server.encoders.base import VisionEncoder
from encode_server.metrics import Metrics

__all__ = ["main"]


def _encoder_loader(settings: Settings) -> Callable[[], VisionEncoder]:
    return partial(
        load_encoder,
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        output=settings.output,
        revision=settings.revision,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(sys.argv[1:] if argv is None else argv, os.environ)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    runtime = Runtime(settings, Metrics())
    app = create_app(runtime, _encoder_loader(settings))
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it to the handler that was there
    # before; make that one a no-op so a clean drain exits 0, as orchestrators expect.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=30,
    )
    return 1 if runtime.load_error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
