"""Large uploads the way a hostile or bursty client sends them, over a raw socket, and the server's
resident memory sampled from /proc while they run.

``upload`` sends the request head, then the body in 1 MiB slices, and stops sending the moment
the server answers (or closes): so a test can see how many body bytes the server took before it
refused, and how long the refusal took. httpx can't tell us either (it sends the whole body
before it reads a response)."""

from __future__ import annotations

import base64
import io
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

__all__ = [
    "MIB",
    "Payload",
    "RssSampler",
    "Upload",
    "chunked",
    "json_payload",
    "mixed_payloads",
    "multipart_payload",
    "noise_png",
    "random_bytes",
    "raw_payload",
    "read_response",
    "reset_peak_rss",
    "rss_bytes",
    "upload",
]

MIB = 1024 * 1024
_SLICE = MIB


@dataclass(frozen=True)
class Payload:
    """One request body and its content type (the same bytes object is sent many times)."""

    kind: str
    content_type: str
    body: bytes


def raw_payload(data: bytes, kind: str = "raw") -> Payload:
    return Payload(kind, "application/octet-stream", data)


def json_payload(data: bytes, kind: str = "json") -> Payload:
    return Payload(kind, "application/json", b'{"items": [{"data": "' + base64.b64encode(data) + b'"}]}')


def multipart_payload(data: bytes, kind: str = "multipart") -> Payload:
    boundary = uuid.uuid4().hex.encode()
    head = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="x.png"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n")
    tail = b"\r\n--" + boundary + b"--\r\n"
    return Payload(kind, "multipart/form-data; boundary=" + boundary.decode(), head + data + tail)


def noise_png(nbytes: int, seed: int = 0) -> bytes:
    """A real PNG of random pixels (incompressible), about ``nbytes`` long."""
    side = int((nbytes / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


@dataclass
class Upload:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    sent: int = 0  # body bytes the socket took before the answer came (or the send failed)
    seconds: float = 0.0  # from the request head to the complete answer
    error: str | None = None


def chunked(total: int | None) -> Iterator[bytes]:
    """A chunked-encoding body of ``total`` bytes of zeros (None: forever)."""
    piece = b"\0" * _SLICE
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    while total is None or sent < total:
        yield frame
        sent += len(piece)
    yield b"0\r\n\r\n"


def _slices(body: bytes) -> Iterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(body), _SLICE):
        yield view[start:start + _SLICE]


def upload(
    port: int,
    path: str,
    body: bytes | Iterable[bytes],
    *,
    content_type: str = "application/octet-stream",
    content_length: int | None = None,
    extra: bytes = b"",
    stop_on_answer: bool = True,
    timeout: float = 60.0,
) -> Upload:
    """POST ``body`` (bytes: declared with its length unless ``content_length`` says otherwise; an
    iterable of already-framed pieces: sent chunked), then ``extra`` bytes after it; unless
    ``stop_on_answer`` is False, sending stops as soon as the server answers."""
    result = Upload()
    if isinstance(body, bytes | bytearray):
        length = len(body) if content_length is None else content_length
        framing = f"Content-Length: {length}\r\n"
        pieces: Iterable[bytes | memoryview] = _slices(bytes(body))
    else:
        framing = "Transfer-Encoding: chunked\r\n"
        pieces = body
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n{framing}\r\n").encode()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            for piece in [*pieces, *_slices(extra)] if extra else pieces:
                if stop_on_answer and select.select([sock], [], [], 0)[0]:
                    break  # the server answered (or closed) before the body was all sent
                sock.sendall(piece)
                result.sent += len(piece)
        except OSError as exc:  # the server closed while we were still sending
            result.error = type(exc).__name__
        read_response(sock, result)
    result.seconds = time.monotonic() - started
    return result


def read_response(sock: socket.socket, result: Upload) -> Upload:
    """Read one response (head, and a body of its Content-Length) into ``result``."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return result
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        result.status = int(lines[0].split()[1])
        result.headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        want = int(result.headers.get("content-length", "0"))
        while len(rest) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        result.body = rest[:want]
    except OSError as exc:
        result.error = result.error or type(exc).__name__
    return result


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field_name} for {pid}")


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, our own child); False where not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """The largest VmRSS seen while the block runs, sampled every ``interval`` s; with
    ``reset_peak_rss`` also VmHWM, which no sample can miss."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.hwm_reset = False
        self.hwm = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.hwm_reset = reset_peak_rss(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))
        self.hwm = rss_bytes(self.pid, "VmHWM") if self.hwm_reset else self.peak
        self.peak = max(self.peak, self.hwm)


def random_bytes(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(nbytes)


def mixed_payloads(size: int) -> list[Payload]:
    """Raw, JSON base64 and multipart bodies of about ``size`` bytes: random bytes (refused 400
    from the image header) and real noise PNGs (decoded: their pixels are charged too)."""
    noise = random_bytes(size)
    return [
        raw_payload(noise),
        json_payload(noise[: size * 3 // 4 - 64]),
        multipart_payload(noise),
        raw_payload(noise_png(size, seed=1), "png"),
        json_payload(noise_png(size * 3 // 4 - 64, seed=2), "png-json"),
        multipart_payload(noise_png(size, seed=3), "png-multipart"),
    ]
