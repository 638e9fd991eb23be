"""encode-server's client: hash locally, send hash-only first, upload only the misses.

Needs neither torch nor the server package. This is the first, synchronous cut; the async client,
retries, replica affinity, gRPC and the CLI build on it.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from blake3 import blake3

__all__ = ["Client", "EncodeError", "Result", "mm_hash", "to_numpy"]


def mm_hash(data: bytes) -> str:
    """Lowercase hex BLAKE3-256 of the image file's bytes (what ``b3sum`` prints)."""
    return blake3(data).hexdigest()


def to_numpy(raw: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """Raw little-endian tensor bytes to numpy; bfloat16 widens exactly to float32."""
    if dtype == "bfloat16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


class EncodeError(Exception):
    """An error answer from the server: its status, ``type`` and the failing item's ``index``."""

    def __init__(self, status: int, type: str, message: str, index: int | None) -> None:
        super().__init__(f"{status} {type}: {message}" + (f" (item {index})" if index is not None else ""))
        self.status, self.type, self.message, self.index = status, type, message, index


@dataclass(frozen=True)
class Result:
    hash: str
    status: str
    source: str | None
    shape: tuple[int, ...]
    dtype: str
    meta: dict[str, Any] = field(default_factory=dict)
    raw: bytes = b""

    def numpy(self) -> np.ndarray:
        return to_numpy(self.raw, self.dtype, self.shape)


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, timeout: float = 60.0) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def encode(self, images: Iterable[bytes | str | Path]) -> list[Result]:
        """Embeddings for ``images`` (bytes or paths), in order. Bytes travel only for misses."""
        blobs = [Path(i).read_bytes() if isinstance(i, (str, Path)) else bytes(i) for i in images]
        hashes = [mm_hash(b) for b in blobs]
        items = self._post([{"hash": h} for h in hashes])
        misses = [i for i, item in enumerate(items) if item["status"] == "miss"]
        if misses:
            uploaded = self._post([{"hash": hashes[i], "data": base64.b64encode(blobs[i]).decode()} for i in misses])
            for i, item in zip(misses, uploaded, strict=True):
                items[i] = item
        return [
            Result(
                hash=item["hash"],
                status=item["status"],
                source=item["source"],
                shape=tuple(item["shape"]),
                dtype=item["dtype"],
                meta=item.get("meta", {}),
                raw=base64.b64decode(item["embedding"]),
            )
            for item in items
        ]

    def _post(self, items: list[dict[str, str]]) -> list[dict[str, Any]]:
        r = self._http.post("/v1/encode", json={"items": items})
        if r.status_code != 200:
            err = r.json().get("error", {})
            raise EncodeError(r.status_code, err.get("type", "unknown"), err.get("message", r.text), err.get("index"))
        return list(r.json()["items"])
