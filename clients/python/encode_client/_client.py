"""``Client`` and ``AsyncClient``: the I/O only. Each drives the shared flows of ``BaseClient``
by sending ``Call``s over HTTP (httpx) or gRPC and sleeping when told; neither holds logic of
its own, so the two cannot drift apart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx

from encode_client import _http
from encode_client._base import BaseClient, Call, Flow, Sleep
from encode_client._errors import ReplicaUnavailable
from encode_client._images import ImageInput
from encode_client._lanes import AsyncLanes
from encode_client._types import LookupItem, Result, TokenCount, WarmItem

if TYPE_CHECKING:
    from encode_client._aio import AioHttp

__all__ = ["AsyncClient", "Client"]

T = TypeVar("T")

# gRPC answers carry whole embeddings; the server's own --max-request-bytes bounds requests.
_GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def _grpc_target(replica: str) -> str:
    return replica.removeprefix("grpc://")


class Client(BaseClient):
    """Synchronous client. ``with Client(["http://a:8000", "http://b:8000"]) as c: c.encode(paths)``."""

    def __init__(
        self, urls: str | Sequence[str] = "http://127.0.0.1:8000", *, pool: httpx.Limits | None = None, **options: Any
    ) -> None:
        """``pool``: httpx's connection-pool limits (keep-alive connections per replica and in all)."""
        super().__init__(urls, **options)
        self._http = httpx.Client(timeout=self.timeout, limits=pool or httpx.Limits())
        self._stubs: dict[str, Any] = {}
        self._channels: list[Any] = []

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()
        for channel in self._channels:
            channel.close()

    def encode(
        self, images: Sequence[ImageInput], *, mm_processor_kwargs: Mapping[str, Any] | None = None
    ) -> list[Result]:
        """Embeddings for ``images`` (paths, bytes, PIL images, or videos: a video file's path or
        bytes, detected by suffix or content, or wrapped in ``Video``), in order. Bytes travel only
        for items that no replica tier holds, once per distinct file. ``mm_processor_kwargs``: the
        processor settings of every item, in vLLM's names (a server started with
        ``--trust-request-mm-kwargs``)."""
        return self._run(self._encode_flow(images, settings=mm_processor_kwargs))

    def hand_off(
        self,
        images: Sequence[ImageInput],
        *,
        modality: str | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[Result]:
        """The EPD hand-off: make sure each image is in the server's shared tier (hash first,
        upload only the misses) and get its metadata and store ``key`` back, no embedding bytes.
        Needs a server with ``--redis-url`` (else ``ServerError`` 409 ``no_shared_tier``).
        ``modality``: ``"image"`` or ``"video"`` for every item, instead of telling each by its name
        or first bytes (``Video`` wraps one). ``mm_processor_kwargs``: as for ``encode``."""
        return self._run(self._encode_flow(images, "handoff", modality, mm_processor_kwargs))

    def lookup(
        self, hashes: Sequence[str], *, modality: str = "image", mm_processor_kwargs: Mapping[str, Any] | None = None
    ) -> list[LookupItem]:
        """Which tier holds each hash, as an ``"image"`` or a ``"video"`` item (under these settings)."""
        return self._run(self._lookup_flow(hashes, modality, mm_processor_kwargs))

    def warm(self, images: Sequence[ImageInput]) -> list[WarmItem]:
        return self._run(self._warm_flow(images))

    def tokens(
        self,
        images: Sequence[ImageInput] = (),
        *,
        sizes: Sequence[tuple[int, int]] = (),
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[TokenCount]:
        """Tokens per image or video (a video's from its container's header) or per image size,
        under ``mm_processor_kwargs`` (as for ``encode``)."""
        return self._run(self._tokens_flow(images, sizes, mm_processor_kwargs))

    def model(self) -> dict[str, Any]:
        return self._run(self._model_flow())

    # -- I/O ------------------------------------------------------------------------------------

    def _run(self, flow: Flow[T]) -> T:
        try:
            step = next(flow)
            while True:
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                    step = flow.send([])
                else:
                    step = flow.send([self._send(call) for call in step])
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    def _send(self, call: Call) -> Any:
        try:
            if call.replica.startswith("grpc://"):
                return self._send_grpc(call)
            req = _http.build(call.replica, call.op, call.payload, response=self.response, api_key=self.api_key)
            try:
                r = self._http.request(
                    req.method, req.url, json=req.json, content=req.content, files=req.files, headers=req.headers
                )
            except httpx.TransportError as exc:
                raise ReplicaUnavailable(call.replica, repr(exc)) from exc
            return _http.parse(call.op, r.status_code, r.headers, r.content, call.replica)
        except Exception as exc:
            return exc

    def _send_grpc(self, call: Call) -> Any:
        import grpc

        from encode_client import _grpc
        from encode_client._proto import encoder_pb2_grpc

        stub = self._stubs.get(call.replica)
        if stub is None:
            channel = grpc.insecure_channel(_grpc_target(call.replica), options=_GRPC_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[call.replica] = encoder_pb2_grpc.EncoderStub(channel)
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
        method = getattr(stub, _grpc.METHODS[call.op])
        try:
            response = method(_grpc.build(call.op, call.payload), metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise _grpc.error(exc, call.replica) from exc
        return _grpc.parse(call.op, response, call.replica)


class AsyncClient(BaseClient):
    """asyncio client; the calls of one round (one per replica and chunk) go out concurrently."""

    def __init__(
        self,
        urls: str | Sequence[str] = "http://127.0.0.1:8000",
        *,
        pool: httpx.Limits | None = None,
        lanes: int = 1,
        http: Literal["httpx", "aiohttp"] = "httpx",
        **options: Any,
    ) -> None:
        """``pool``: see ``Client``; ``lanes``: that many httpx pools sharing ``pool``, used in turn
        (for many concurrent calls: one httpx pool slows down with its connections, ``_lanes``);
        ``http="aiohttp"``: HTTP calls over one aiohttp pool instead (``_aio``: a fraction of
        httpx's CPU per call; aiohttp comes with the ``proxy`` extra)."""
        super().__init__(urls, **options)
        self._lanes = AsyncLanes(lanes, timeout=self.timeout, limits=pool)
        self._aio: AioHttp | None = None
        if http == "aiohttp":
            from encode_client._aio import AioHttp

            self._aio = AioHttp(self.timeout, pool)
        self._stubs: dict[str, Any] = {}
        self._channels: list[Any] = []

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._lanes.aclose()
        if self._aio is not None:
            await self._aio.aclose()
        for channel in self._channels:
            await channel.close()

    async def encode(
        self, images: Sequence[ImageInput], *, mm_processor_kwargs: Mapping[str, Any] | None = None
    ) -> list[Result]:
        """See ``Client.encode``."""
        return await self._run(self._encode_flow(images, settings=mm_processor_kwargs))

    async def hand_off(
        self,
        images: Sequence[ImageInput],
        *,
        modality: str | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[Result]:
        """See ``Client.hand_off``."""
        return await self._run(self._encode_flow(images, "handoff", modality, mm_processor_kwargs))

    async def lookup(
        self, hashes: Sequence[str], *, modality: str = "image", mm_processor_kwargs: Mapping[str, Any] | None = None
    ) -> list[LookupItem]:
        """Which tier holds each hash, as an ``"image"`` or a ``"video"`` item (under these settings)."""
        return await self._run(self._lookup_flow(hashes, modality, mm_processor_kwargs))

    async def warm(self, images: Sequence[ImageInput]) -> list[WarmItem]:
        return await self._run(self._warm_flow(images))

    async def tokens(
        self,
        images: Sequence[ImageInput] = (),
        *,
        sizes: Sequence[tuple[int, int]] = (),
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[TokenCount]:
        """See ``Client.tokens``."""
        return await self._run(self._tokens_flow(images, sizes, mm_processor_kwargs))

    async def model(self) -> dict[str, Any]:
        return await self._run(self._model_flow())

    # -- I/O ------------------------------------------------------------------------------------

    async def _run(self, flow: Flow[T]) -> T:
        try:
            step = next(flow)
            while True:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                    step = flow.send([])
                else:
                    step = flow.send(list(await asyncio.gather(*(self._send(call) for call in step))))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _send(self, call: Call) -> Any:
        try:
            if call.replica.startswith("grpc://"):
                return await self._send_grpc(call)
            req = _http.build(call.replica, call.op, call.payload, response=self.response, api_key=self.api_key)
            if self._aio is not None:
                return _http.parse(call.op, *await self._aio.request(req, call.replica), call.replica)
            try:
                r = await self._lanes.next().request(
                    req.method, req.url, json=req.json, content=req.content, files=req.files, headers=req.headers
                )
            except httpx.TransportError as exc:
                raise ReplicaUnavailable(call.replica, repr(exc)) from exc
            return _http.parse(call.op, r.status_code, r.headers, r.content, call.replica)
        except Exception as exc:
            return exc

    async def _send_grpc(self, call: Call) -> Any:
        import grpc

        from encode_client import _grpc
        from encode_client._proto import encoder_pb2_grpc

        stub = self._stubs.get(call.replica)
        if stub is None:
            channel = grpc.aio.insecure_channel(_grpc_target(call.replica), options=_GRPC_OPTIONS)
            self._channels.append(channel)
            stub = self._stubs[call.replica] = encoder_pb2_grpc.EncoderStub(channel)
        metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
        method = getattr(stub, _grpc.METHODS[call.op])
        try:
            response = await method(_grpc.build(call.op, call.payload), metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise _grpc.error(exc, call.replica) from exc
        return _grpc.parse(call.op, response, call.replica)
