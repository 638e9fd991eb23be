"""The ``AsyncClient``'s HTTP calls over aiohttp (``AsyncClient(http="aiohttp")``), for a caller
that makes many small calls at once and counts their CPU: the EPD proxy, one hand-off per chat.

Why: per call, httpx (httpcore and anyio under it) costs several times aiohttp's CPU
(``bench/proxy_clients.py``). One aiohttp pool is enough: it does not slow down with its
connections as httpcore's does (``_lanes``). aiohttp is the proxy's extra, not the client's, so
this module is imported only when asked for.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

from encode_client._errors import ReplicaUnavailable
from encode_client._http import HttpRequest

__all__ = ["AioHttp"]


class AioHttp:
    """One aiohttp session, made at the first call (inside the event loop that uses it):
    ``limits``' connections at most, an idle one kept ``limits.keepalive_expiry`` seconds;
    ``timeout`` seconds for a connection (a free one included) and for each read. An answer is
    ``(status, headers, body)``; a connection refused, broken or silent is ``ReplicaUnavailable``,
    as httpx's ``TransportError`` is for the httpx path, so failover and retries are the same."""

    def __init__(self, timeout: float, limits: httpx.Limits | None) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout, sock_read=timeout)
        self._limit = (limits.max_connections if limits is not None else None) or 0
        self._keepalive = (limits.keepalive_expiry if limits is not None else None) or 5.0
        self._session: aiohttp.ClientSession | None = None

    async def request(self, req: HttpRequest, replica: str) -> tuple[int, dict[str, str], bytes]:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=self._keepalive)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        data: aiohttp.FormData | bytes | None = req.content
        if req.files is not None:
            data = aiohttp.FormData()
            for name, (filename, content, content_type) in req.files:
                data.add_field(name, content, filename=filename, content_type=content_type)
        try:
            body_args = {"json": req.json} if req.json is not None else {"data": data}
            async with self._session.request(req.method, req.url, headers=req.headers, **body_args) as answer:
                body = await answer.read()
                return answer.status, {k.lower(): v for k, v in answer.headers.items()}, body
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise ReplicaUnavailable(replica, repr(exc)) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
