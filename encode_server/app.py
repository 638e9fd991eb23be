"""The composition root: the one place where a server is put together, run and taken apart.

Everything concrete is built here and handed down (settings -> metrics -> runtime -> encoder ->
tiers -> batcher -> service -> front doors), so each piece can be read, and tested, alone: the
HTTP and gRPC front doors receive the ``Runtime``; neither starts the other, loads a model or
builds a tier; the service receives its tiers and batcher; ``cli.py`` only parses flags.

:meth:`EncodeServer.serve` is the whole lifecycle in one function, in this order, and the reverse
on the way out. The front doors bind *before* the model loads, so that an orchestrator's probes
get answers while a large model loads (``/health`` 200; ``/ready`` and gRPC health "not ready"):
they serve no work until the service is handed to the runtime.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING

import grpc
import uvicorn

from encode_server.admission import MemoryCharge
from encode_server.api.connections import uvicorn_options
from encode_server.api.grpc import start_grpc_server
from encode_server.api.http import create_app
from encode_server.api.ports import PortUnavailable, bind_listener
from encode_server.api.runtime import Runtime
from encode_server.cache.base import SharedTier
from encode_server.cache.export import FileExporter, check_directory
from encode_server.cache.local import LocalTier
from encode_server.cache.redis import check_url, create_redis_tier, redact_url
from encode_server.config import Settings
from encode_server.core.batcher import Batcher
from encode_server.core.budget import ByteBudget
from encode_server.core.errors import EncodeServerError
from encode_server.core.settings import RequestSettings
from encode_server.core.sglang_wire import SglangContract
from encode_server.core.stored import ValueSpec
from encode_server.core.types import EncodedTensor
from encode_server.encoders import FAMILIES, check_local_model, load_encoder, resolve_device
from encode_server.encoders.base import Encoder, PreparedItem
from encode_server.encoders.threads import MAX_AUTO_WORKERS, CoreShare, forward_workers
from encode_server.fingerprints import serving_fingerprint
from encode_server.heap import GcPauses, freeze_startup_heap
from encode_server.kinds import kinds_for
from encode_server.malloc import release_free_memory
from encode_server.metrics import Metrics
from encode_server.preprocess_procs import PreprocessProcesses
from encode_server.service import EncodeService, Served
from encode_server.warmup import WarmupFailed, prepare_to_serve

if TYPE_CHECKING:  # pyzmq is an optional extra: imported only when --sglang builds the door
    from encode_server.api.sglang import SglangDoor

__all__ = [
    "DrainingServer", "EncodeServer", "EncoderLoader", "StartFailed", "build_service", "check_device", "file_exporter",
    "give_back_memory", "run", "shared_tier",
]

log = logging.getLogger("encode_server")

EncoderLoader = Callable[[], Encoder]


class StartFailed(Exception):
    """The server could not start (a taken port, a missing ``--model`` directory): one line, exit 1."""


def encoder_loader(settings: Settings) -> EncoderLoader:
    """``--model`` and its options, loaded when called (in a thread: it can take minutes)."""
    return partial(
        load_encoder,
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        output=settings.output,
        revision=settings.revision,
        preprocess_device=settings.preprocess_device,
        cuda_graph_tokens=settings.cuda_graph_max_tokens if settings.cuda_graphs else 0,
    )


class EncodeServer:
    """One server: its settings, the runtime both front doors share, and its lifecycle.

    ``load_encoder`` defaults to ``--model``; a test can hand in its own (gated, or a small model).
    ``shutdown()`` does what SIGTERM does, from any thread: drain, then stop.
    """

    def __init__(self, settings: Settings, *, load_encoder: EncoderLoader | None = None) -> None:
        self.settings = settings
        self.load_encoder = load_encoder or encoder_loader(settings)
        self.metrics = Metrics()
        self.runtime = Runtime(settings, self.metrics)
        self.sglang = sglang_door(self.runtime)
        self.http = DrainingServer(_uvicorn_config(settings, self.runtime, self.sglang), self.runtime,
                                   settings.drain_seconds, self.sglang.withdraw if self.sglang is not None else None)
        self.exit_code = 0

    async def serve(self) -> int:
        """The lifecycle: doors up, model in, serve, drain, doors down, everything closed.

        Both doors bind before either says it listens; a start that fails (a taken port, a
        ``--model`` directory that is not there) logs one line and returns 1 with nothing open."""
        try:
            http_socket, grpc_server = await self._open_doors()
        except StartFailed as exc:
            log.error("not started: %s", exc)
            return 1
        self._say_auth()
        http = asyncio.create_task(self.http.serve([http_socket]), name="http")
        # Threads are made as passes need them: --forward-workers (found at load) bounds how many.
        forward = ThreadPoolExecutor(max(self.settings.forward_workers, MAX_AUTO_WORKERS), thread_name_prefix="forward")
        trimmer = asyncio.create_task(give_back_memory(self.runtime.budget), name="give-back-memory")
        gc_pauses = GcPauses(self.metrics.observe_gc_pause)
        gc_pauses.install()
        service: EncodeService | None = None
        try:
            loading = asyncio.create_task(self._build_service(forward), name="load")
            await asyncio.wait({http, loading}, return_when=asyncio.FIRST_COMPLETED)
            if loading.done() and loading.exception() is None:
                service = loading.result()
                self.runtime.service = service  # ready: /ready 200, gRPC health SERVING
            else:
                self._stop_loading(loading)
            await http  # until SIGTERM and its drain (DrainingServer), then uvicorn's shutdown
        finally:
            self.runtime.draining = True
            if not http.done():
                self.http.should_exit = True
                await asyncio.gather(http, return_exceptions=True)
            http_socket.close()
            if grpc_server is not None:
                # Its calls were drained with HTTP's (or, stopping at once, answered 503).
                await grpc_server.stop(grace=0 if self.runtime.stopping else 3)
            if self.sglang is not None:
                await self.sglang.close()  # unregistered from SGLang's bootstraps, its ZMQ sockets closed
            if service is not None:
                await service.close()  # the batcher, the shared tier's writer, the pools
            forward.shutdown(wait=False, cancel_futures=True)
            trimmer.cancel()
            gc_pauses.remove()
        return self.exit_code

    def shutdown(self) -> None:
        """Drain and stop, as SIGTERM does; safe from any thread."""
        self.http.request_drain()

    # -- steps -------------------------------------------------------------------------------------

    def _say_auth(self) -> None:
        """Who may call /v1/*, said once the doors are open (a refused start says only why)."""
        keys, isolation = self.runtime.keys, self.settings.tenant_isolation
        if keys is None:
            log.info("no API keys configured: /v1/* is open")
            if isolation:
                log.warning("--tenant-isolation without API keys: every request is in the default tenant")
        else:
            log.info("%d API key(s), tenant isolation %s", len(keys), "on" if isolation else "off")

    async def _open_doors(self) -> tuple[socket.socket, grpc.aio.Server | None]:
        """``--model`` checked (when it is a path), then the HTTP socket bound and listening, then
        gRPC bound and started; ``StartFailed`` leaves nothing open. Only gRPC logs here: it is
        the last door to bind, so its "listening" line is never followed by a failed bind."""
        s = self.settings
        try:
            check_local_model(s.model)
        except FileNotFoundError as exc:
            raise StartFailed(f"--model: {exc}") from None
        check_device(s.device)
        if s.export_dir is not None:
            try:
                check_directory(s.export_dir)
            except OSError as exc:
                raise StartFailed(f"--export-dir: {exc}") from None
        if s.redis_url is not None:
            try:
                check_url(s.redis_url)
            except ValueError as exc:
                raise StartFailed(f"--redis-url: {exc}") from None
        try:
            http_socket = bind_listener("HTTP", "--port", s.host, s.port)
        except PortUnavailable as exc:
            raise StartFailed(str(exc)) from None
        try:
            extra = self.sglang.add_grpc if self.sglang is not None else None
            return http_socket, await start_grpc_server(self.runtime, extra) if s.grpc_port else None
        except PortUnavailable as exc:
            http_socket.close()
            raise StartFailed(str(exc)) from None

    async def _build_service(self, forward: ThreadPoolExecutor) -> EncodeService:
        """Encoder -> tiers -> batcher -> service, warmed up. A failure stops the server (exit 1)."""
        s, metrics = self.settings, self.metrics
        started = time.perf_counter()
        encoder = await asyncio.to_thread(self.load_encoder)
        contract = sglang_contract(encoder) if self.sglang is not None else None
        procs = await asyncio.to_thread(preprocess_processes, encoder, s)
        service = build_service(
            encoder, s, metrics, forward, shared=await shared_tier(s, metrics, encoder), budget=self.runtime.budget,
            exporter=file_exporter(s, encoder), procs=procs,
        )
        await service.start()
        if service.warmup is not None:
            log.info("%s", service.warmup.line())
        log.info("%s", service.passes.line())
        # What loading and the warm-up left alive is out of the collector's walks from now (heap.py).
        frozen = freeze_startup_heap()
        metrics.gc_frozen_objects.set(frozen)
        if self.sglang is not None and contract is not None:
            self.sglang.serve(contract)
        log.info("%d objects alive after the warm-up frozen out of the garbage collector's walks", frozen)
        info = encoder.info
        log.info(
            "model %s loaded and warm in %.2f s: kind=%s device=%s dtype=%s (%s) fingerprint=%s",
            info.model_id, time.perf_counter() - started, info.kind, info.device, info.dtype, encoder.dtype_reason,
            service.fingerprint,
        )
        if info.meaningless:
            log.warning(
                "%s has random weights: its embeddings are deterministic but MEANINGLESS; "
                "pass --model for a real encoder", info.model_id,
            )
        return service

    def _stop_loading(self, loading: asyncio.Task[EncodeService]) -> None:
        """The doors stopped first (SIGTERM while loading), or the load failed: stop the other."""
        if not loading.done():
            loading.cancel()  # the loader thread finishes on its own; nothing waits for it
            return
        exc = loading.exception()
        # A bad checkpoint or model id is a reason, not a bug: one line; anything else, its traceback.
        if isinstance(exc, WarmupFailed):  # a worst case this server cannot hold: its figures, one line
            log.error("%s; shutting down", exc)
        else:
            expected = isinstance(exc, (OSError, ValueError))
            log.error("model failed to load: %s; shutting down", exc, exc_info=None if expected else exc)
        self.runtime.load_error = exc
        self.exit_code = 1
        self.http.should_exit = True


async def give_back_memory(
    budget: ByteBudget, quiet_s: float = 1.0, busy_s: float = 30.0, release: Callable[[], object] = release_free_memory
) -> None:
    """What the heap kept of finished requests goes back to the OS (``malloc.release_free_memory``)
    once requests have stopped for ``quiet_s``, and every ``busy_s`` under steady load; never per
    request, which would make each one fault its working set in again. The budget's byte counter
    says whether requests came since the last look."""
    seen = trimmed = budget.acquired_total
    last_trim = time.monotonic()
    while True:
        await asyncio.sleep(quiet_s)
        now = budget.acquired_total
        quiet = now == seen and budget.used == 0
        seen = now
        if now != trimmed and (quiet or time.monotonic() - last_trim >= busy_s):
            await asyncio.to_thread(release)
            trimmed, last_trim = now, time.monotonic()


def build_service(
    encoder: Encoder,
    settings: Settings,
    metrics: Metrics,
    forward: Executor,
    *,
    shared: SharedTier | None = None,
    budget: ByteBudget | None = None,
    exporter: FileExporter | None = None,
    procs: PreprocessProcesses | None = None,
) -> EncodeService:
    """The service over its tiers: the local LRU, ``shared`` (or none), and the encoder's batcher,
    whose forward passes run on ``forward``, ``--forward-workers`` of them at once (the executor
    must have that many threads); on a CPU they share torch's threads (``encoders/threads.py``).
    Each input kind the family takes (``kinds/``) charges what decoding an item holds to
    ``budget`` (the runtime's); the warm-up runs when the service starts."""
    workers = forward_workers(settings.forward_workers, encoder.info.device, batched=encoder.preprocesses_on_device)
    run_batch: Callable[[Sequence[PreparedItem]], Sequence[EncodedTensor | EncodeServerError]] = encoder.forward
    if workers > 1 and encoder.info.device == "cpu":
        share = CoreShare(encoder.forward)
        log.info("forward passes: up to %d side by side, sharing %d torch threads", workers, share.cores)
        run_batch = share
    batcher: Batcher[PreparedItem, EncodedTensor] = Batcher(
        run_batch,
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_wait_s=settings.max_wait_ms / 1000.0,  # no bound of its own: the service admits (--max-queue)
        executor=forward,
        observer=metrics.observe_batch,
        concurrency=workers,
    )
    local = LocalTier(settings.cache_bytes, metrics)
    memory = MemoryCharge(budget, metrics, max_pixels=settings.max_image_pixels)
    family = encoder.family.describe() if encoder.family is not None else None
    served = Served(encoder.info, family, encoder.dtype_reason, serving_fingerprint(encoder, settings))
    capacity = budget.capacity if budget is not None else None
    return EncodeService(
        served, settings, metrics, local=local, batcher=batcher, kinds=kinds_for(encoder, settings, memory, procs),
        item_settings=request_settings(encoder, settings), shared=shared, exporter=exporter,
        warm=partial(prepare_to_serve, encoder, settings, budget=capacity),
    )


def preprocess_processes(encoder: Encoder, settings: Settings) -> PreprocessProcesses | None:
    """``--preprocess-processes`` workers, started (each loads the encoder's host twin), or None."""
    if not settings.preprocess_processes:
        return None
    try:
        procs = PreprocessProcesses(encoder, settings.preprocess_processes)
    except (ValueError, pickle.PicklingError, TypeError, AttributeError) as exc:
        raise StartFailed(f"--preprocess-processes: {exc}") from None
    try:
        procs.start(encoder)
    except (ValueError, RuntimeError) as exc:
        procs.close()
        raise StartFailed(f"--preprocess-processes: {exc}") from None
    log.info("images decoded and preprocessed in %d worker processes", procs.count)
    return procs


def request_settings(encoder: Encoder, settings: Settings) -> RequestSettings:
    """The per-request settings this server takes (``core/settings.py``): the family's keys, the
    checkpoint's defaults for them (the server's where a key has one, as ``fps`` is
    ``--video-fps``), capped by ``--max-image-pixels``."""
    declared = encoder.family.settings if encoder.family is not None else ()
    defaults = encoder.setting_defaults() if declared else {}
    defaults |= {s.name: getattr(settings, s.server_default) for s in declared if s.server_default is not None}
    return RequestSettings(declared, defaults, {"max_image_pixels": float(settings.max_image_pixels)},
                           trusted=settings.trust_request_mm_kwargs)


async def shared_tier(settings: Settings, metrics: Metrics, encoder: Encoder) -> SharedTier | None:
    """The Redis tier when ``--redis-url`` is set, pinged once so that its start-up line says
    whether Redis answers. It checks every value it reads against this model's fingerprint,
    dtype and hidden size."""
    if not settings.redis_url:
        return None
    info = encoder.info
    spec = ValueSpec(serving_fingerprint(encoder, settings), info.dtype, info.hidden_size,
                     frozenset(info.widths.values()))
    tier = create_redis_tier(settings, metrics, spec)
    where = redact_url(settings.redis_url)
    down = await tier.check_reachable()
    if down is None:
        log.info("shared tier: %s (%s, reachable), ttl %d s", tier.name, where, settings.redis_ttl)
    else:
        log.warning("shared tier: %s (%s, unreachable: %s); serving from the local tier until it returns",
                    tier.name, where, down)
    return tier


def check_device(device: str) -> None:
    """``StartFailed`` when this torch build cannot use ``--device`` (``cuda`` on a CPU-only
    build, or with no GPU visible): said before a port opens, not as a traceback from the load."""
    if not device.startswith("cuda"):
        return
    try:
        resolve_device("cuda")  # CUDA initialised: the build has it and a device is visible
    except (AssertionError, RuntimeError) as exc:
        raise StartFailed(f"--device {device}: this torch cannot use CUDA ({exc})") from None


def file_exporter(settings: Settings, encoder: Encoder) -> FileExporter | None:
    """``--export-dir``: vLLM's stock EC file layout, for deployments without our connector."""
    if settings.export_dir is None:
        return None
    exporter = FileExporter(settings.export_dir, settings.export_max_bytes, serving_fingerprint(encoder, settings))
    log.info("exporting embeddings to %s (%d files, budget %.0f MiB)", settings.export_dir, len(exporter),
             settings.export_max_mb)
    return exporter


def sglang_door(runtime: Runtime) -> SglangDoor | None:
    """SGLang's front door when ``--sglang`` asks for it; pyzmq (the ``sglang`` extra) is imported only then."""
    if not runtime.settings.sglang:
        return None
    try:
        from encode_server.api.sglang import SglangDoor
    except ImportError as exc:
        raise SystemExit(f"--sglang needs pyzmq (the sglang extra: pip install '.[sglang]' in the clone): "
                         f"{exc}") from None
    return SglangDoor(runtime)


def sglang_contract(encoder: Encoder) -> SglangContract:
    """How SGLang takes this encoder's embeddings; a family SGLang's language-only mode does not take
    stops the start (``ValueError``: the load's one-line reason)."""
    family = encoder.family
    if family is None or family.sglang is None:
        taking = ", ".join(f.name for f in FAMILIES if f.sglang is not None)
        raise ValueError(f"--sglang: {encoder.info.model_id} ({family.name if family else 'no family'}) is not a "
                         f"family SGLang's language-only prefill takes from an encoder; these are: {taking}")
    return family.sglang


def _uvicorn_config(settings: Settings, runtime: Runtime, sglang: SglangDoor | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(runtime, sglang),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        loop=__import__("os").environ.get("X_LOOP", "auto"),
        log_config=None,  # ours (configure_logging), text or JSON
        access_log=False,  # the front doors write the one access line per request
        # The drain already waited for requests; this only bounds closing idle connections.
        timeout_graceful_shutdown=5,
        **uvicorn_options(settings, runtime.metrics),  # header/body timeouts, connection cap
    )


# How long a stop at once waits for the 503s it answered to be written before the doors close.
STOP_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain in front of its shutdown, as orchestrators expect.

    The first SIGTERM sets ``runtime.draining`` at once (``/ready`` turns 503, ``/v1/*`` and gRPC
    refuse new work with 503 ``not_ready``) while the server keeps accepting connections, so that
    probes and late clients get a clear answer; once the requests in flight on both doors have
    finished, or ``drain_seconds`` have passed, uvicorn's own graceful shutdown runs.

    A second SIGTERM, or a SIGINT (Ctrl-C), stops at once (``Runtime.stop_now``): the requests in
    flight on both doors are cancelled and answered 503 ``not_ready`` (a client retries elsewhere),
    then the doors close without waiting for anything else. Past that a signal is uvicorn's: a
    further SIGINT forces its exit.
    """

    def __init__(self, config: uvicorn.Config, runtime: Runtime, drain_seconds: float,
                 on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_seconds = drain_seconds
        self.on_drain = on_drain  # at the drain's start: leave what routes work here (SGLang's bootstraps)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task[None] | None = None
        self._stopping = False
        self._stop: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up on the socket ``EncodeServer`` bound (uvicorn says nothing then);
        "listening" is said only by a server still meant to run (not after a failed load)."""
        await super().startup(sockets)
        if self.started and not self.should_exit and sockets:
            host, port = sockets[0].getsockname()[:2]
            log.info("HTTP listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.request_drain():
            return
        if self.request_stop("SIGINT" if sig == signal.SIGINT else "second SIGTERM"):
            return
        super().handle_exit(sig, frame)

    def request_drain(self) -> bool:
        """Start the drain (once, from any thread); False when it cannot start (not serving yet,
        or already draining or stopping)."""
        if self._loop is None or self.runtime.draining or self.should_exit:
            return False
        self.runtime.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)
        return True

    def request_stop(self, why: str) -> bool:
        """Stop at once (once, from any thread); False when it cannot (not serving yet, or
        already stopping)."""
        if self._loop is None or self._stopping:
            return False
        self._stopping = True
        self._loop.call_soon_threadsafe(self._start_stop, why)
        return True

    def _start_stop(self, why: str) -> None:
        self._stop = asyncio.create_task(self._stop_then_exit(why))

    async def _stop_then_exit(self, why: str) -> None:
        if self._drain is not None:
            self._drain.cancel()
        cancelled = self.runtime.stop_now()
        log.warning("%s: stopping now; %d request(s) in flight answered 503 not_ready", why, cancelled)
        # Their answers are written at once (nothing awaits but the send); the bound is for a client
        # too slow to take a response already under way, which the stop then cuts.
        await self.runtime.drain(STOP_GRACE_S)
        # uvicorn's shutdown then finds no request to wait for; it still closes the lifespan,
        # which force_exit would leave to be cancelled (a traceback in the log).
        self.should_exit = True

    def _start_drain(self) -> None:
        self._drain = asyncio.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        inflight = self.runtime.inflight
        log.info("SIGTERM: draining %d request(s) in flight, for at most %g s", inflight, self.drain_seconds)
        if self.on_drain is not None:
            await self.on_drain()
        if await self.runtime.drain(self.drain_seconds):
            log.info("drained; shutting down")
        else:
            left = self.runtime.inflight
            log.warning("drain time (%g s) is up with %d request(s) still in flight", self.drain_seconds, left)
        self.should_exit = True


def run(settings: Settings) -> int:
    """Serve until SIGTERM (drained), a second SIGTERM or SIGINT (stopped at once); the exit code
    (0; 1 when the model failed to load)."""
    server = EncodeServer(settings)
    # Once stopped, uvicorn re-raises the signals it caught to the handlers that were there before
    # it started: no-ops, so that a clean stop exits 0 (SIGINT's default would raise
    # KeyboardInterrupt out of the loop, with its traceback).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: None)
    try:
        loop_factory = server.http.config.get_loop_factory()  # uvloop where installed, as uvicorn.run
        if loop_factory is None or sys.version_info < (3, 11):
            return asyncio.run(server.serve())
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(server.serve())
    finally:
        # The doors are closed; what is left is the exit waiting for a forward pass or a decode
        # already running on a core: a further signal ends the process at once.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)

