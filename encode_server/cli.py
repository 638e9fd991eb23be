"""``encode-server``: build the settings once, load the model behind the HTTP server, serve."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from functools import partial
from types import FrameType

import uvicorn

from encode_server.api.connections import uvicorn_options
from encode_server.api.http import create_app
from encode_server.api.runtime import Runtime
from encode_server.auth import ApiKeys
from encode_server.config import Settings, settings_from
from encode_server.encoders import load_encoder
from encode_server.encoders.base import VisionEncoder
from encode_server.logs import configure_logging
from encode_server.metrics import Metrics

__all__ = ["DrainingServer", "main"]

log = logging.getLogger("encode_server")


def _encoder_loader(settings: Settings) -> Callable[[], VisionEncoder]:
    return partial(
        load_encoder,
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        output=settings.output,
        revision=settings.revision,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain in front of its shutdown, as orchestrators expect.

    The first SIGTERM sets ``runtime.draining`` at once (``/ready`` turns 503, ``/v1/*`` refuses
    new work with 503 ``not_ready``) while the server keeps accepting connections, so that probes
    and late clients get a clear answer; once the requests in flight have finished, or
    ``drain_seconds`` have passed, uvicorn's own graceful shutdown runs. A second SIGTERM, or a
    SIGINT, skips the drain (uvicorn's behaviour: stop now).
    """

    def __init__(self, config: uvicorn.Config, runtime: Runtime, drain_seconds: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_seconds = drain_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self._loop is not None and not self.runtime.draining and not self.should_exit:
            self.runtime.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        inflight = self.runtime.inflight
        log.info("SIGTERM: draining %d request(s) in flight, for at most %g s", inflight, self.drain_seconds)
        if await self.runtime.drain(self.drain_seconds):
            log.info("drained; shutting down")
        else:
            left = self.runtime.inflight
            log.warning("drain time (%g s) is up with %d request(s) still in flight", self.drain_seconds, left)
        self.should_exit = True


def main(argv: Sequence[str] | None = None) -> int:
    settings = settings_from(sys.argv[1:] if argv is None else argv, os.environ)
    configure_logging(settings.log_level, settings.log_format)
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
    runtime = Runtime(settings, Metrics())
    app = create_app(runtime, _encoder_loader(settings))
    # After a drain uvicorn re-raises SIGTERM to the handler that was there before it started;
    # make that one a no-op so a clean drain exits 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # ours (configure_logging), text or JSON
        access_log=False,  # the middleware writes the one access line per request
        # The drain already waited for requests; this only bounds closing idle connections.
        timeout_graceful_shutdown=5,
        **uvicorn_options(settings, runtime.metrics),  # header/body timeouts, connection cap
    )
    DrainingServer(config, runtime, settings.drain_seconds).run()
    return 1 if runtime.load_error is not None else 0


if __name__ == "__main__":
    sys.exit(main())
