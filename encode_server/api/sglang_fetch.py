"""An SGLang ``mm_items`` entry to its bytes: what SGLang's prefill may send an encoder, under our limits.

SGLang's tokenizer hands its encoder each media item as the client gave it: an ``http(s)://`` URL, a
``data:`` URI, raw base64, a ``file://`` URL or a local path, alone or as ``{"url": ..., "content_hash":
"sha256:<hex>", ...}``. SGLang's own encoder fetches and opens anything; this server does not:

- a URL is fetched only from a public address: every address the name resolves to, and the peer
  the connection really reached (a DNS answer that changes between the two is caught there), must
  not be private, loopback, link-local, multicast, reserved or unspecified, unless
  ``--sglang-fetch-private`` allows them (a test's loopback server; a cluster's internal media
  store). Redirects are followed (at most :data:`MAX_REDIRECTS`), each one checked again. The body
  is bounded as an upload is: at most ``--max-request-bytes``, charged to the request-memory budget
  as it arrives; the whole fetch within ``--request-timeout``.
- a local file is read only inside ``--sglang-file-dir`` (its real path, links resolved); without
  that flag every path is refused.
- ``content_hash`` (SGLang's ``sha256:<64 hex>`` of the bytes) is checked against the bytes:
  a mismatch is 400 ``hash_mismatch``, as SGLang's own encoder refuses it.

The bytes then go through the service like any upload: hashed (BLAKE3) for the cache, decoded with
the upload limits.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import ipaddress
import os
import socket
import ssl
import stat
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from encode_server.api.bodies import decode_base64
from encode_server.core.budget import Hold
from encode_server.core.errors import BadInput, InvalidRequest, TooLarge

__all__ = ["MAX_REDIRECTS", "FetchPolicy", "check_content_hash", "resolve_item"]

MAX_REDIRECTS = 3
CONTENT_HASH_PREFIX = "sha256:"
# Per-item keys SGLang forwards that would change preprocessing: refused, never silently ignored.
_PREPROCESSING_KEYS = ("max_dynamic_patch", "preprocess_kwargs", "max_long_side_pixel")
_CHUNK = 1 << 16


@dataclass(frozen=True)
class FetchPolicy:
    """What this server may read for an SGLang item: the upload limit, private addresses, a file root;
    ``executor``: the threads fetches and reads run on (None: the loop's default)."""

    max_bytes: int
    timeout: float
    allow_private: bool = False
    file_dir: str | None = None
    executor: Executor | None = field(default=None, compare=False)


def check_content_hash(expected: object, data: bytes, index: int) -> None:
    """SGLang's ``content_hash`` (``sha256:<hex>``) against the bytes: 400 when malformed or different."""
    if expected is None:
        return
    if not isinstance(expected, str) or not expected.startswith(CONTENT_HASH_PREFIX):
        raise BadInput("content_hash must use the form 'sha256:<64 hex digits>'", type="invalid_hash", index=index)
    digest = expected[len(CONTENT_HASH_PREFIX):].lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise BadInput("content_hash must contain exactly 64 SHA-256 hex digits", type="invalid_hash", index=index)
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise BadInput(f"Encoder media content hash mismatch: expected sha256:{digest}, got sha256:{actual}",
                       type="hash_mismatch", index=index)


async def resolve_item(entry: object, index: int, policy: FetchPolicy, hold: Hold | None) -> bytes:
    """One ``mm_items`` entry's bytes (fetched, decoded or read), its ``content_hash`` checked."""
    content_hash: object = None
    if isinstance(entry, Mapping):
        if "url" not in entry:
            raise InvalidRequest("an mm_items entry is a URL string or an object with a 'url'", index=index)
        _refuse_preprocessing(entry, index)
        content_hash, entry = entry.get("content_hash"), entry["url"]
    if not isinstance(entry, str) or not entry:
        raise InvalidRequest("an mm_items entry's url must be a non-empty string", index=index)
    head = entry[:8].lower()
    if head.startswith(("http://", "https://")):
        data = await _off_loop(policy, _fetch, entry, index, policy, hold)
    elif head.startswith("data:"):
        data = decode_base64(entry, index, hold)
    elif head.startswith("file://") or _a_path(entry):
        data = await _off_loop(policy, _read_file, entry, index, policy, hold)
    else:  # SGLang's last resort: the string is the base64 of the file
        try:
            data = decode_base64(entry, index, hold)
        except BadInput:
            if not entry.startswith("/"):
                raise
            data = await _off_loop(policy, _read_file, entry, index, policy, hold)  # "/etc/passwd": a path
    check_content_hash(content_hash, data, index)
    return data


async def _off_loop(policy: FetchPolicy, work: Callable[..., bytes], *args: Any) -> bytes:
    """``work`` on the door's own fetch threads (bounded: slow servers cannot take the threads the
    rest of the server shares), else on the loop's default executor."""
    return await asyncio.get_running_loop().run_in_executor(policy.executor, work, *args)


# Raw base64 of a JPEG starts with "/9j/": a string is a local path only where it cannot be base64.
_BASE64_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n\r")


def _a_path(entry: str) -> bool:
    """A relative or home path, or an absolute one with a character base64 never holds (a dot, a
    dash...); anything else is tried as base64 first, as SGLang reads a string that names no file
    (an absolute path that is not base64 either is then read as a path: ``file://`` says it plainly)."""
    if entry.startswith(("./", "../", "~")):
        return True
    return entry.startswith("/") and not set(entry[:4096]) <= _BASE64_ALPHABET


def _refuse_preprocessing(entry: Mapping[str, Any], index: int) -> None:
    asked = [key for key in _PREPROCESSING_KEYS if entry.get(key) not in (None, {}, [])]
    if asked:
        raise BadInput(f"per-item preprocessing {asked} is not applied by encode-server's SGLang door; send the item "
                       "without it", type="invalid_setting", index=index)


def _read_file(entry: str, index: int, policy: FetchPolicy, hold: Hold | None) -> bytes:
    if policy.file_dir is None:
        raise BadInput("local paths are refused: start the server with --sglang-file-dir to serve files from a "
                       "directory", type="url_refused", index=index)
    raw = unquote(urlsplit(entry).path) if entry[:7].lower() == "file://" else entry
    root = Path(policy.file_dir).resolve()
    path = Path(raw).expanduser().resolve()
    if not path.is_relative_to(root):
        raise BadInput(f"{raw} is outside --sglang-file-dir", type="url_refused", index=index)
    try:
        # Opened without blocking (a FIFO would wait for a writer), then checked: what is checked
        # is what is read.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise BadInput(f"{raw} is not a regular file", type="url_refused", index=index)
            if info.st_size > policy.max_bytes:
                raise TooLarge(f"{raw} is {info.st_size} bytes, above the limit of {policy.max_bytes} "
                               "(--max-request-bytes)", index=index)
            if hold is not None:
                hold.grow_or_raise(info.st_size)
            data = file.read(policy.max_bytes + 1)  # a file that grew meanwhile is read no further
    except OSError as exc:
        raise BadInput(f"cannot read {raw}: {exc.strerror}", type="fetch_failed", index=index) from None
    if len(data) > policy.max_bytes:
        raise TooLarge(f"{raw} is above the limit of {policy.max_bytes} bytes (--max-request-bytes)", index=index)
    return data


def _public(address: str) -> bool:
    """A globally routable unicast address (not private, shared like 100.64.0.0/10 where cloud
    metadata services live, loopback, link-local, reserved...), the IPv4 inside an IPv6 address
    (mapped, 6to4, Teredo) checked as well."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    inner: list[ipaddress.IPv4Address] = []
    if isinstance(ip, ipaddress.IPv6Address):
        inner = [a for a in (ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())) if a is not None]
    return all(a.is_global and not a.is_multicast for a in (ip, *inner))


class _Refused(Exception):
    pass


def _guarded(allow_private: bool) -> Callable[..., socket.socket]:
    """``http.client``'s connect, refusing a peer outside the policy before a byte is sent (TLS included):
    the address the connection really reached, whatever the name resolved to a moment before."""

    def create_connection(address: tuple[str, int], timeout: float | None = None,
                          source_address: tuple[str, int] | None = None) -> socket.socket:
        sock = socket.create_connection(address, timeout, source_address)
        peer = sock.getpeername()[0]
        if not allow_private and not _public(peer):
            sock.close()
            raise _Refused(f"it resolves to {peer}, a private address (--sglang-fetch-private allows it)")
        return sock

    return create_connection


def _fetch(url: str, index: int, policy: FetchPolicy, hold: Hold | None) -> bytes:
    deadline = time.monotonic() + policy.timeout
    for _ in range(MAX_REDIRECTS + 1):
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:  # a port out of range, a malformed IPv6 literal
            raise BadInput(f"cannot fetch {url!r}: {exc}", type="url_refused", index=index) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadInput(f"cannot fetch {url!r}: only http(s) URLs with a host", type="url_refused", index=index)
        if not policy.allow_private:
            try:
                found = {info[4][0] for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)}
            except (OSError, ValueError) as exc:  # ValueError: UnicodeError of a malformed name
                raise BadInput(f"cannot fetch {url}: {exc}", type="fetch_failed", index=index) from None
            if private := sorted(a for a in found if not _public(str(a))):
                raise BadInput(f"cannot fetch {url}: {parts.hostname} resolves to {private[0]}, a private address "
                               "(--sglang-fetch-private allows it)", type="url_refused", index=index)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BadInput(f"cannot fetch {url}: no time left (--request-timeout)", type="fetch_failed", index=index)
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, port, timeout=remaining,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(parts.hostname, port, timeout=remaining)
        conn._create_connection = _guarded(policy.allow_private)  # type: ignore[attr-defined]
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        try:
            conn.request("GET", path, headers={"User-Agent": "encode-server", "Accept-Encoding": "identity"})
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("location"):
                url = urljoin(url, response.getheader("location") or "")
                continue
            if response.status != 200:
                raise BadInput(f"cannot fetch {url}: HTTP {response.status}", type="fetch_failed", index=index)
            return _read_bounded(response, conn.sock, url, index, policy.max_bytes, hold, deadline)
        except _Refused as exc:
            raise BadInput(f"cannot fetch {url}: {exc}", type="url_refused", index=index) from None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise BadInput(f"cannot fetch {url}: {exc}", type="fetch_failed", index=index) from None
        finally:
            conn.close()
    raise BadInput(f"cannot fetch {url}: more than {MAX_REDIRECTS} redirects", type="fetch_failed", index=index)


def _read_bounded(response: http.client.HTTPResponse, sock: socket.socket | None, url: str, index: int, limit: int,
                  hold: Hold | None, deadline: float) -> bytes:
    """The body, at most ``limit`` bytes, all of it by ``deadline`` (a server that trickles its bytes
    is cut there: each read may wait only for what is left of the time)."""
    declared = response.getheader("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{url} is {declared} bytes, above the limit of {limit} (--max-request-bytes)", index=index)
    body = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BadInput(f"cannot fetch {url}: not all of it within --request-timeout", type="fetch_failed",
                           index=index)
        if sock is not None:
            sock.settimeout(left)
        chunk = response.read1(_CHUNK)  # what one receive brings: read() would wait to fill the chunk
        if not chunk:
            break
        if len(body) + len(chunk) > limit:
            raise TooLarge(f"{url} is above the limit of {limit} bytes (--max-request-bytes)", index=index)
        if hold is not None:
            hold.grow_or_raise(len(chunk))
        body += chunk
    return bytes(body)
