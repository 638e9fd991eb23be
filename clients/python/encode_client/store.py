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
``dtype``, ``shape``, ``meta``), parsed by the strict codec in :mod:`encode_client.safetensors`
and checked here by :func:`read_value`, the function the server reads its own tier with: a value
that is malformed, of another format version, or whose fingerprint or mm_hash is not the key's,
raises :class:`CorruptValue` instead of returning wrong numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from encode_client.safetensors import SafetensorsError, WireTensor, dump_safetensors, load_safetensors, to_numpy

__all__ = [
    "VALUE_FORMAT", "CorruptValue", "StoreReader", "StoredEmbedding", "dump_value", "parse_value", "read_value",
]

VALUE_FORMAT = "encode-server/embedding/v1"
TENSOR_NAME = "embedding"
VALUE_FIELDS = frozenset({"format", "fingerprint", "mm_hash", "dtype", "shape", "meta"})
VALUE_DTYPES = frozenset({"float32", "bfloat16", "float16"})


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
        return to_numpy(WireTensor(TENSOR_NAME, self.dtype, self.shape, self.data))

    def torch(self) -> Any:
        """A torch tensor in the stored dtype (bfloat16 stays bfloat16); needs torch installed."""
        import torch

        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


def dump_value(fingerprint: str, mm_hash: str, tensor: WireTensor, meta: dict[str, Any]) -> bytes:
    """The stored value of one embedding (what the server writes; tests and tools may too)."""
    metadata = {
        "format": VALUE_FORMAT,
        "fingerprint": fingerprint,
        "mm_hash": mm_hash,
        "dtype": tensor.dtype,
        "shape": json.dumps(list(tensor.shape), separators=(",", ":")),
        "meta": json.dumps(meta, separators=(",", ":"), sort_keys=True),
    }
    return dump_safetensors([WireTensor(TENSOR_NAME, tensor.dtype, tensor.shape, tensor.data)], metadata)


def read_value(blob: bytes, *, where: str = "value") -> StoredEmbedding:
    """Parse and validate one stored value on its own; raise :class:`CorruptValue`.

    The one validator of stored values (the server reads its tier through it too). Accepted only
    when the blob is strict safetensors holding exactly the tensor ``embedding`` of shape
    [N >= 1, D] in a float dtype, and its metadata has exactly :data:`VALUE_FIELDS`, all agreeing
    with the tensor. ``where`` names the value in error messages. ``key`` of the result is ``""``:
    :func:`parse_value` checks the value against the key it was read under."""
    try:
        tensors, metadata = load_safetensors(blob)
    except SafetensorsError as exc:
        raise CorruptValue(f"{where}: not a safetensors value: {exc}") from None
    if set(metadata) != VALUE_FIELDS:
        raise CorruptValue(f"{where}: metadata fields {sorted(metadata)}, expected {sorted(VALUE_FIELDS)}")
    if metadata["format"] != VALUE_FORMAT:
        raise CorruptValue(f"{where}: format {metadata['format']!r}, expected {VALUE_FORMAT!r}")
    if set(tensors) != {TENSOR_NAME}:
        raise CorruptValue(f"{where}: expected exactly one tensor {TENSOR_NAME!r}, got {sorted(tensors)}")
    tensor = tensors[TENSOR_NAME]
    if tensor.dtype not in VALUE_DTYPES or tensor.dtype != metadata["dtype"]:
        raise CorruptValue(f"{where}: dtype {tensor.dtype!r} does not match metadata {metadata['dtype']!r}")
    try:
        meta_shape, meta = json.loads(metadata["shape"]), json.loads(metadata["meta"])
    except (ValueError, RecursionError) as exc:  # deep nesting is not a ValueError
        raise CorruptValue(f"{where}: metadata shape/meta are not JSON: {exc}") from None
    shape = list(tensor.shape)
    if len(shape) != 2 or min(shape) < 1 or meta_shape != shape:
        raise CorruptValue(f"{where}: shape {shape!r} (metadata {meta_shape!r}) is not a valid [N >= 1, D]")
    if not isinstance(meta, dict):
        raise CorruptValue(f"{where}: meta must be a JSON object, got {type(meta).__name__}")
    fp, mm_hash = metadata["fingerprint"], metadata["mm_hash"]
    return StoredEmbedding("", mm_hash, fp, tensor.dtype, tensor.shape, tensor.data, meta)


def parse_value(key: str, blob: bytes, *, fingerprint: str | None = None) -> StoredEmbedding:
    """Parse and validate one stored value read under ``key``; raise :class:`CorruptValue`.

    :func:`read_value`, and the value's fingerprint and mm_hash are the key's
    (``...:{fingerprint}:...:{mm_hash}``); ``fingerprint``, when given (``GET /v1/model``), too."""
    stored = read_value(blob, where=key)
    fp, mm_hash = stored.fingerprint, stored.mm_hash
    if not key.endswith(":" + mm_hash) or f":{fp}:" not in key:
        raise CorruptValue(f"{key}: the value's fingerprint/mm_hash ({fp[:12]}.../{mm_hash[:12]}...) are not the key's")
    if fingerprint is not None and fp != fingerprint:
        raise CorruptValue(f"{key}: fingerprint {fp[:12]}..., expected {fingerprint[:12]}...")
    return replace(stored, key=key)


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

    def read_many(self, keys: Sequence[str]) -> list[StoredEmbedding | CorruptValue | None]:
        """Like :meth:`get_many`, one round trip, but a bad value comes back as its
        :class:`CorruptValue` in place instead of raising, so one bad key cannot hide the others."""
        if not keys:
            return []
        blobs = self._client.mget_nonatomic(list(keys)) if self._cluster else self._client.mget(list(keys))
        out: list[StoredEmbedding | CorruptValue | None] = []
        for key, blob in zip(keys, blobs, strict=True):
            try:
                out.append(None if blob is None else parse_value(key, blob, fingerprint=self.fingerprint))
            except CorruptValue as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
