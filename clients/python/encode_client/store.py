"""Read embeddings straight from the server's Redis store: the prefill side of the EPD hand-off.

The server answers ``"return": "metadata"`` with a ``key`` per item once the embedding is in
Redis; a prefill worker reads it here, without the embedding crossing the encode server again::

    from encode_client.store import StoreReader

    with StoreReader("redis://redis:6379/0") as store:          # or redis+cluster://, rediss://
        emb = store.get(item["key"])                             # None if evicted or expired
        x = emb.numpy()        # float32 for bf16 values (widened exactly), else the stored dtype
        t = emb.torch()        # torch.bfloat16 kept as is (needs torch)

Needs ``pip install 'encode-client[store]'`` (redis-py); never imports the server. The value is a
safetensors blob (tensor ``embedding``; metadata ``format``, ``fingerprint``, ``mm_hash``,
``dtype``, ``shape``, ``meta``), parsed here by a small strict reader and checked exactly as the
server checks it: a value that is malformed, of another format version, or whose fingerprint or
mm_hash is not the key's, raises :class:`CorruptValue` instead of returning wrong numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CorruptValue", "StoreReader", "StoredEmbedding", "parse_value"]

VALUE_FORMAT = "encode-server/embedding/v1"
_FIELDS = frozenset({"format", "fingerprint", "mm_hash", "dtype", "shape", "meta"})
# safetensors dtype code -> (our name, item size, numpy spelling or None for bfloat16)
_DTYPES = {"F32": ("float32", 4, "<f4"), "F16": ("float16", 2, "<f2"), "BF16": ("bfloat16", 2, None)}
_MAX_HEADER = 100_000_000


class CorruptValue(ValueError):
    """The value under a key is not a valid embedding for that key; do not use it."""


@dataclass(frozen=True)
class StoredEmbedding:
    key: str
    mm_hash: str
    fingerprint: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes = field(repr=False)
    meta: dict[str, Any] = field(default_factory=dict)

    def numpy(self) -> np.ndarray:
        """float32/float16 as stored; bfloat16 widened to float32 exactly (bits shifted left by 16)."""
        if self.dtype == "bfloat16":
            bits = np.frombuffer(self.data, dtype="<u2").astype("<u4") << 16
            return bits.view("<f4").reshape(self.shape)
        return np.frombuffer(self.data, dtype=_DTYPES[_code(self.dtype)][2]).reshape(self.shape)

    def torch(self) -> Any:
        """A torch tensor in the stored dtype (bfloat16 stays bfloat16); needs torch installed."""
        import torch

        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


def _code(dtype: str) -> str:
    return next(code for code, (name, _, _) in _DTYPES.items() if name == dtype)


def parse_value(key: str, blob: bytes, *, fingerprint: str | None = None) -> StoredEmbedding:
    """Parse and validate one stored value read under ``key``; raise :class:`CorruptValue`."""
    if len(blob) < 8:
        raise CorruptValue(f"{key}: {len(blob)} bytes is too short for a safetensors value")
    n = int.from_bytes(blob[:8], "little")
    if n > min(_MAX_HEADER, len(blob) - 8):
        raise CorruptValue(f"{key}: header length {n} runs past the {len(blob)}-byte value")
    try:
        header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptValue(f"{key}: header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptValue(f"{key}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    strings = isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    if not strings or set(metadata) != _FIELDS:
        raise CorruptValue(f"{key}: metadata must have exactly the string fields {sorted(_FIELDS)}")
    if metadata["format"] != VALUE_FORMAT:
        raise CorruptValue(f"{key}: format {metadata['format']!r}, expected {VALUE_FORMAT!r}")
    mm_hash, fp = metadata["mm_hash"], metadata["fingerprint"]
    if not key.endswith(":" + mm_hash) or f":{fp}:" not in key:
        raise CorruptValue(f"{key}: the value's fingerprint/mm_hash ({fp[:12]}.../{mm_hash[:12]}...) are not the key's")
    if fingerprint is not None and fp != fingerprint:
        raise CorruptValue(f"{key}: fingerprint {fp[:12]}..., expected {fingerprint[:12]}...")
    entry = header.get("embedding")
    if set(header) != {"embedding"} or not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CorruptValue(f"{key}: expected exactly one tensor 'embedding', got {sorted(header)}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in _DTYPES or _DTYPES[code][0] != metadata["dtype"]:
        raise CorruptValue(f"{key}: dtype {code!r} does not match metadata {metadata['dtype']!r}")
    ok_shape = isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d >= 1 for d in shape)
    try:
        meta_shape, meta = json.loads(metadata["shape"]), json.loads(metadata["meta"])
    except (ValueError, RecursionError) as exc:  # deep nesting is not a ValueError
        raise CorruptValue(f"{key}: metadata shape/meta are not JSON: {exc}") from None
    if not ok_shape or meta_shape != shape or not isinstance(meta, dict):
        raise CorruptValue(f"{key}: shape {shape!r} (metadata {meta_shape!r}) is not a valid [N, D]")
    size = math.prod(shape) * _DTYPES[code][1]
    if offsets != [0, size] or len(blob) - 8 - n != size:
        raise CorruptValue(f"{key}: data_offsets {offsets!r} / {len(blob) - 8 - n} data bytes, expected {size}")
    return StoredEmbedding(key, mm_hash, fp, _DTYPES[code][0], tuple(shape), bytes(blob[8 + n :]), meta)


class StoreReader:
    """A synchronous reader of the server's Redis store (single node, cluster, or TLS).

    ``redis+cluster://`` (or ``cluster=True``) uses redis-py's cluster client; ``get_many`` is one
    round trip per node. ``fingerprint`` (from ``GET /v1/model``), when given, is checked too.
    """

    def __init__(
        self, url: str, *, cluster: bool = False, fingerprint: str | None = None, timeout: float = 2.0
    ) -> None:
        import redis
        import redis.cluster

        self.fingerprint = fingerprint
        for scheme in ("redis+cluster://", "rediss+cluster://"):
            if url.startswith(scheme):
                cluster, url = True, url.replace("+cluster", "", 1)
        options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
        self._cluster = cluster
        self._client: Any = (
            redis.cluster.RedisCluster.from_url(url, **options) if cluster else redis.Redis.from_url(url, **options)
        )

    def get(self, key: str) -> StoredEmbedding | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[StoredEmbedding | None]:
        """None for a key that is absent (evicted, expired); CorruptValue for a bad value."""
        if not keys:
            return []
        blobs = self._client.mget_nonatomic(list(keys)) if self._cluster else self._client.mget(list(keys))
        return [
            None if blob is None else parse_value(key, blob, fingerprint=self.fingerprint)
            for key, blob in zip(keys, blobs, strict=True)
        ]

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
