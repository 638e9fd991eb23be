"""SGLang's front door: its encoder protocol over HTTP (and its embeddings over ZMQ), behind our service.

A ``--language-only`` SGLang prefill names its encoders in ``--encoder-urls`` and, per request,
``POST {encoder}/encode``s each encoder its part of the request's items (``req_id`` is
``<rid>_local_part_<k>``). This door answers as SGLang 0.5.23's own encoder does, so the prefill
cannot tell the difference, but every item goes through the same service as ``/v1/encode`` (the
local and Redis tiers, single flight, the batcher, the memory budget, the API keys, the metrics):

1. the body is checked as SGLang's encoder checks it (400 ``{"status": "error", "message", "req_id"}``);
2. each ``mm_items`` entry becomes bytes (``sglang_fetch``: URLs, data URIs, base64, paths under
   ``--sglang-file-dir``; its ``content_hash`` checked), then an upload item of the request's modality;
3. the service resolves them (a repeat is a cache hit); the part's rows are the items' rows in
   order, its ``grid_dim`` their grids, with the family's extras (``Family.sglang``);
4. the part goes to the prefill as SGLang's ZMQ message (``core.sglang_wire``): with an
   ``embedding_port`` (``zmq_to_tokenizer``) to ``tcp://prefill_host:embedding_port``; without one
   (``zmq_to_scheduler``) to each ``host:port`` the ranks registered with ``/scheduler_receive_url``,
   before or after this request, until ``receive_count`` have had it (``sglang_push``);
5. 200 ``null`` once delivered. A failure after step 1 pushes SGLang's error frame to the same
   receivers (so the prefill fails the request at once, never waits for its timeout), then answers
   non-200 with the message and the status SGLang turns into the user's abort code (400 for an
   undecodable image, 413 over a limit, 503 overloaded, 504 timeout, 502 when no receiver took the
   message).

The routes are bound methods of :class:`SglangDoor`, which the composition root builds and hands
the HTTP app (``create_app(runtime, sglang=door)``), with the family's :class:`SglangContract` once
the model is loaded.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from encode_server.api.bodies import read_body
from encode_server.api.budget import body_hold, over_budget
from encode_server.api.frontdoor import RequestRecord, authorize, check_count, retry_after
from encode_server.api.runtime import Runtime
from encode_server.api.sglang_fetch import FetchPolicy, resolve_item
from encode_server.api.sglang_push import DeliveryFailed, Full, Pusher, Registrations, endpoint_of
from encode_server.api.status import status_for
from encode_server.core.budget import Hold, OverBudget
from encode_server.core.errors import BadInput, EncodeServerError, TooLarge, Unavailable
from encode_server.core.sglang_wire import (
    SGLANG_MODALITIES,
    FloatTensor,
    SglangContract,
    Value,
    embedding_message,
    error_message,
)
from encode_server.core.types import ItemResult, RequestItem
from encode_server.service import EncodeService

__all__ = ["ROUTES", "Failure", "Part", "Refused", "SglangDoor", "assemble_part", "parse_encode", "sglang_body"]

log = logging.getLogger(__name__)

ROUTES = ("/encode", "/scheduler_receive_url")
REGISTER_RETRIES = 30  # SGLang's encoder: 30 tries, 5 s apart, per bootstrap
REGISTER_INTERVAL_S = 5.0
FETCH_THREADS = 16  # items fetched by URL at once, over every request


class Refused(Exception):
    """A request SGLang's own encoder refuses before encoding: 400, no error frame."""


class Part:
    """One ``/encode`` request as SGLang sends it, checked."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self.req_id: str = body["req_id"]
        self.modality: str = body["modality"].upper()
        self.num_parts: int = body["num_parts"]
        self.part_idx: int = body["part_idx"]
        items = body["mm_items"]
        self.items: list[Any] = list(items) if isinstance(items, (list, tuple)) else [items]
        self.prefill_host: str | None = body.get("prefill_host")
        self.embedding_port: int | list[int] | None = body.get("embedding_port")

    def endpoints(self) -> list[str] | None:
        """Where ``zmq_to_tokenizer`` (or SGLang's older per-rank ports) send; None: the registered ranks."""
        if self.embedding_port is None:
            return None
        ports = self.embedding_port if isinstance(self.embedding_port, list) else [self.embedding_port]
        return [endpoint_of(f"{self.prefill_host}:{port}") for port in ports]


def parse_encode(body: object) -> Part:
    """SGLang's ``validate_encode_request``, with the delivery fields too: ``Refused`` names what is wrong."""
    if not isinstance(body, dict):
        raise Refused(f"request is not a dict: {type(body).__name__}")
    req_id = body.get("req_id")
    if not isinstance(req_id, str) or not req_id:
        raise Refused("missing or invalid req_id")
    modality = body.get("modality")
    if not isinstance(modality, str):
        raise Refused("missing or invalid modality")
    if modality.upper() not in SGLANG_MODALITIES:
        raise Refused(f"unsupported modality: {modality}")
    items = body.get("mm_items")
    if items is None or (isinstance(items, (list, tuple)) and not items):
        raise Refused("missing or empty mm_items")
    num_parts, part_idx = body.get("num_parts"), body.get("part_idx")
    if not isinstance(num_parts, int) or isinstance(num_parts, bool) or num_parts <= 0:
        raise Refused("num_parts must be a positive integer")
    if not isinstance(part_idx, int) or isinstance(part_idx, bool) or not 0 <= part_idx < num_parts:
        raise Refused(f"part_idx must be in [0, {num_parts})")
    port = body.get("embedding_port")
    ports = port if isinstance(port, list) else [port]
    if port is not None:
        if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports):
            raise Refused("embedding_port must be a port number, a list of them, or null")
        if not isinstance(body.get("prefill_host"), str) or not body["prefill_host"]:
            raise Refused("an embedding_port needs its prefill_host")
    part = Part(body)
    try:
        part.endpoints()
    except ValueError as exc:
        raise Refused(f"prefill_host: {exc}") from None
    return part


def assemble_part(part: Part, results: Sequence[ItemResult], contract: SglangContract) -> list[bytes | memoryview]:
    """The part's ZMQ message: its items' rows in order, one grid row each, and the family's extras."""
    modality = SGLANG_MODALITIES[part.modality]
    grid_key = contract.grids[modality]
    tensors, grids = [], []
    for r in results:
        if r.embedding is None:  # an upload is never a miss; a guard, not a path
            raise EncodeServerError(f"item {r.index} was not resolved", index=r.index)
        tensor = r.embedding.tensor
        grid = r.embedding.meta.get(grid_key)
        if grid is None:
            raise EncodeServerError(f"item {r.index}'s meta has no {grid_key}", index=r.index)
        tensors.append(tensor)
        grids.append([int(v) for v in grid])
    first = tensors[0]
    if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in tensors):
        raise EncodeServerError("the part's items differ in dtype or width")
    rows = sum(t.shape[0] for t in tensors)
    data = first.data if len(tensors) == 1 else b"".join(t.data for t in tensors)
    extras: dict[str, Value] = {}
    for extra in contract.extras.get(modality, ()):
        found = [r.embedding.meta.get(extra.meta_key, extra.default) for r in results if r.embedding is not None]
        values: list[Any] = [v for v in found if v is not None]
        if len(values) != len(found):  # the family's meta has none for these items: SGLang reads its default
            continue
        extras[extra.attr] = (FloatTensor(tuple(float(v) for v in values)) if extra.kind == "float32"
                              else [list(v) for v in values])
    return embedding_message(
        req_id=part.req_id, num_parts=part.num_parts, part_idx=part.part_idx, modality=part.modality, grids=grids,
        dtype=first.dtype, shape=[rows, *first.shape[1:]], data=data, extras=extras,
    )


def sglang_body(status: int, message: str, req_id: object, *, type: str | None = None,
                headers: Mapping[str, str] | None = None) -> Response:
    """An error as SGLang's encoder answers it: ``{"status": "error", "message", "req_id"}`` (and our ``type``)."""
    content: dict[str, Any] = {"status": "error", "message": message, "req_id": req_id}
    if type is not None:
        content["type"] = type
    return Response(orjson.dumps(content), status_code=status, media_type="application/json", headers=headers)


@dataclass(frozen=True)
class Failure:
    """What a failed part answers: SGLang reads ``message``, and turns ``status`` into the user's abort code."""

    status: int
    message: str
    type: str | None = None
    retry_after: str | None = None


def _ok() -> Response:
    return Response(b"null", media_type="application/json")


class SglangDoor:
    """SGLang's encoder routes over a ``Runtime``: the registrations, the ZMQ sockets and self-registration."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        s = runtime.settings
        self.contract: SglangContract | None = None  # the family's, handed over once the model is loaded
        self.registrations = Registrations()
        self.pusher = Pusher(timeout=s.request_timeout)
        # Fetches on threads of their own: a slow media server holds one of these, never a thread
        # the rest of the server needs (the loop's default executor).
        self._fetches = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="sglang-fetch")
        self.policy = FetchPolicy(max_bytes=s.max_request_bytes, timeout=s.request_timeout,
                                  allow_private=s.sglang_fetch_private, file_dir=s.sglang_file_dir,
                                  executor=self._fetches)
        self._tasks: set[asyncio.Task[None]] = set()
        self._registered: list[str] = []

    def add_grpc(self, server: Any) -> None:
        """SGLang's ``SglangEncoder`` gRPC service on our gRPC server (``start_grpc_server``'s ``extra``)."""
        from encode_server.api.sglang_grpc import add_sglang_servicer  # it imports this module

        add_sglang_servicer(self, server)

    def install(self, app: FastAPI) -> None:
        app.add_api_route("/encode", self.encode, methods=["POST"], include_in_schema=False)
        app.add_api_route("/scheduler_receive_url", self.receive_url, methods=["POST"], include_in_schema=False)

    # -- routes --------------------------------------------------------------------------------------

    async def encode(self, request: Request) -> Response:
        """SGLang's ``/encode``: resolve a part's items through the service, push them, then answer."""
        record: RequestRecord = request.scope["state"]["record"]
        req_id: object = None
        try:
            tenant = self._tenant(request, record)
            service = self.runtime.require_service()
            hold = body_hold(request.scope)
            body = await read_body(request, self.runtime.settings.max_request_bytes, hold)
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise Refused(f"body is not valid JSON: {exc}") from None
            req_id = obj.get("req_id") if isinstance(obj, dict) else None
            part = parse_encode(obj)
        except Refused as exc:
            return sglang_body(400, str(exc), req_id)
        except EncodeServerError as exc:  # before the request could name its receivers: no error frame
            return self._error_body(exc, req_id)
        failure = await self.run(part, service, tenant, hold, record)
        if failure is None:
            return _ok()
        return sglang_body(failure.status, failure.message, part.req_id, type=failure.type,
                           headers={"Retry-After": failure.retry_after} if failure.retry_after else None)

    async def run(self, part: Part, service: EncodeService, tenant: str | None, hold: Hold | None,
                  record: RequestRecord) -> Failure | None:
        """A checked part, either door: encode, deliver; on a failure, SGLang's error frame pushed
        and what to answer (None: delivered)."""
        record.items = len(part.items)
        try:
            frames = await self._encode_part(part, service, tenant, hold, record)
        except (EncodeServerError, OverBudget) as exc:
            error = over_budget(self.runtime.metrics, exc) if isinstance(exc, OverBudget) else exc
            await self._push_error(part, status_for(error), error.message)
            return Failure(status_for(error), error.message, error.type, retry_after(error))
        except Exception as exc:  # as SGLang's encoder does: the prefill hears of it, then the 500
            log.error("SGLang part %s failed", part.req_id, exc_info=exc)
            await self._push_error(part, 500, str(exc))
            return Failure(500, str(exc))
        try:
            await self._deliver(part, frames)
        except DeliveryFailed as exc:
            log.warning("SGLang part %s not delivered: %s", part.req_id, exc)
            return Failure(502, f"[{part.req_id}] embedding delivery failed: {exc}")
        return None

    def register(self, req_id: object, url: object, count: object) -> None:
        """One rank's receive URL for a part (either door); ``ValueError`` names what is wrong."""
        if not isinstance(req_id, str) or not req_id:
            raise ValueError("missing or invalid req_id")
        if not isinstance(url, str) or not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise ValueError("receive_url must be host:port and receive_count a positive integer")
        endpoint_of(url)
        try:
            self.registrations.register(req_id, url, count)
        except Full as exc:
            raise Unavailable(f"registration refused: {exc}; retry later", type="overloaded", retry_after=1.0) from None

    async def receive_url(self, request: Request) -> Response:
        """SGLang's ``/scheduler_receive_url``: a rank's PULL socket for a part, held until the part is sent."""
        record: RequestRecord = request.scope["state"]["record"]
        req_id: object = None
        try:
            self._tenant(request, record)
            body = orjson.loads(await read_body(request, 64 * 1024, body_hold(request.scope)))
            if not isinstance(body, dict):
                raise ValueError(f"request is not a dict: {type(body).__name__}")
            req_id = body.get("req_id")
            self.register(req_id, body.get("receive_url"), body.get("receive_count"))
        except ValueError as exc:
            return sglang_body(400, str(exc), req_id)
        except EncodeServerError as exc:
            return self._error_body(exc, req_id)
        return _ok()

    # -- steps ---------------------------------------------------------------------------------------

    def _tenant(self, request: Request, record: RequestRecord) -> str | None:
        return authorize(self.runtime, request.headers.get("authorization"), record)

    async def _encode_part(self, part: Part, service: EncodeService, tenant: str | None, hold: Hold | None,
                           record: RequestRecord) -> list[bytes | memoryview]:
        contract = self.contract
        modality = SGLANG_MODALITIES[part.modality]
        if contract is None or modality not in contract.grids:
            takes = ", ".join(m.upper() for m in contract.grids) if contract else "nothing"
            raise BadInput(f"this model's family takes {takes} from SGLang, not {part.modality}",
                           type="unsupported_modality")
        check_count(len(part.items), self.runtime.settings.max_items)
        datas = await asyncio.gather(*(resolve_item(entry, i, self.policy, hold) for i, entry in enumerate(part.items)))
        total = sum(len(d) for d in datas)
        if total > self.policy.max_bytes:  # as an upload: one request's bytes, however they came
            raise TooLarge(f"the part's items are {total} bytes, above the limit of {self.policy.max_bytes} "
                           "(--max-request-bytes)")
        items = [RequestItem(index=i, data=d, modality=modality) for i, d in enumerate(datas)]
        del datas
        results = await service.encode(items, tenant=tenant)
        record.hits = sum(r.status == "hit" for r in results)
        return assemble_part(part, results, contract)

    async def _deliver(self, part: Part, frames: Sequence[bytes | memoryview]) -> None:
        endpoints = part.endpoints()
        if endpoints is not None:
            await asyncio.gather(*(self.pusher.send_once(e, frames) for e in endpoints))
            return
        await self._deliver_to_ranks(part.req_id, frames)

    async def _deliver_to_ranks(self, req_id: str, frames: Sequence[bytes | memoryview]) -> None:
        """Push to every rank registered for ``req_id``, as each registers, until ``receive_count`` have it."""
        deadline = time.monotonic() + self.pusher.timeout
        sent: set[str] = set()
        sends: list[asyncio.Task[None]] = []
        try:
            while True:
                urls, count = self.registrations.current(req_id)
                for url in urls:
                    if url not in sent:
                        sent.add(url)
                        sends.append(asyncio.create_task(self.pusher.send_kept(endpoint_of(url), frames)))
                if count is not None and len(sent) >= count:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeliveryFailed(f"timed out after {self.pusher.timeout:g}s with {len(sent)}/{count} "
                                         "receiver(s) registered")
                await self.registrations.wait(req_id, remaining)
            failed = [r for r in await asyncio.gather(*sends, return_exceptions=True) if isinstance(r, BaseException)]
            if failed:
                raise DeliveryFailed(str(failed[0]))
        finally:
            self.registrations.forget(req_id)
            for task in sends:
                task.cancel()

    async def _push_error(self, part: Part, code: int, message: str) -> None:
        """SGLang's error frame to the part's receivers: at once to a tokenizer, in the background to ranks."""
        frames = error_message(req_id=part.req_id, num_parts=part.num_parts, part_idx=part.part_idx,
                               modality=part.modality, message=message, code=code)
        endpoints = part.endpoints()
        work = (asyncio.gather(*(self.pusher.send_once(e, frames) for e in endpoints)) if endpoints is not None
                else self._deliver_to_ranks(part.req_id, frames))
        if endpoints is not None:
            try:
                await work
            except DeliveryFailed as exc:
                log.warning("SGLang error frame for %s not delivered: %s", part.req_id, exc)
            return
        task = asyncio.create_task(self._quietly(work, part.req_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _quietly(work: Any, req_id: str) -> None:
        try:
            await work
        except DeliveryFailed as exc:
            log.warning("SGLang error frame for %s not delivered: %s", req_id, exc)

    def _error_body(self, exc: EncodeServerError, req_id: object) -> Response:
        headers = {"Retry-After": seconds} if (seconds := retry_after(exc)) is not None else None
        return sglang_body(status_for(exc), exc.message, req_id, type=exc.type, headers=headers)

    # -- lifecycle -----------------------------------------------------------------------------------

    def serve(self, contract: SglangContract) -> None:
        """The loaded family's contract: from now on ``/encode`` encodes; self-registration starts."""
        self.contract = contract
        for bootstrap in self.runtime.settings.sglang_register_list:
            task = asyncio.create_task(self._register(bootstrap), name=f"sglang-register {bootstrap}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def own_url(self, bootstrap: str) -> str:
        """The URL a bootstrap is told: ``--sglang-url``, else this server's address as the bootstrap sees it."""
        s = self.runtime.settings
        if s.sglang_url:
            return s.sglang_url.rstrip("/")
        host = s.host
        if host in ("0.0.0.0", "::", ""):
            parts = urlsplit(bootstrap)
            family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet: only the route is looked up
                probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))
                host = probe.getsockname()[0]
        return f"http://[{host}]:{s.port}" if ":" in host else f"http://{host}:{s.port}"

    async def _register(self, bootstrap: str) -> None:
        """``POST {bootstrap}/register_encoder_url {"url": ...}``, retried as SGLang's encoder retries it."""
        url = self.own_url(bootstrap)
        for _ in range(REGISTER_RETRIES):
            if self.runtime.draining:  # withdrawn meanwhile: never back into the rotation
                return
            status = await asyncio.to_thread(_call, "POST", f"{bootstrap}/register_encoder_url", {"url": url})
            if status == 200:
                log.info("registered %s with SGLang's encoder bootstrap at %s", url, bootstrap)
                self._registered.append(bootstrap)
                return
            await asyncio.sleep(REGISTER_INTERVAL_S)
        log.error("gave up registering %s with SGLang's encoder bootstrap at %s after %d tries", url, bootstrap,
                  REGISTER_RETRIES)

    async def withdraw(self) -> None:
        """Out of SGLang's rotation at once (a drain's start): unregistered from every bootstrap, so
        its prefills stop sending new parts while the ones in flight finish (``/health`` answers
        503 from now, for prefills that list this encoder in ``--encoder-urls``)."""
        registered, self._registered = self._registered, []
        for bootstrap in registered:
            url = self.own_url(bootstrap)
            await asyncio.to_thread(_call, "DELETE", f"{bootstrap}/unregister_encoder_url", {"url": url}, 2.0)

    async def close(self) -> None:
        """Unregister from the bootstraps (if the drain has not), stop the background work, close the sockets."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.withdraw()
        self.pusher.close()
        self._fetches.shutdown(wait=False, cancel_futures=True)


def _call(method: str, url: str, payload: Mapping[str, str], timeout: float = 5.0) -> int | None:
    """One JSON call to a bootstrap; its status, or None when it could not be reached."""
    request = urllib.request.Request(url, data=orjson.dumps(payload), method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        log.warning("SGLang bootstrap %s answered %s %s", url, exc.code, exc.reason)
        return exc.code
    except OSError as exc:
        log.debug("SGLang bootstrap %s not reached: %s", url, exc)
        return None
