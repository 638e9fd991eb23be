"""Embeddings fetched from encode-server by hash: where a prefill worker goes when the shared tier
has no valid value for an item (evicted, expired, corrupt, Redis down) while an E still holds it.

``EncoderFetcher.fetch_many(identifiers)`` asks encode-server for each identifier's item by its
``mm_hash`` and modality alone (``POST /v1/encode``, hash-only items, ``Accept: application/vnd.safetensors``:
the binary answer, no base64), so no image bytes move and the server answers from its local tier
or its own view of Redis, or says ``miss``. Replicas are tried in the client's rendezvous order for
the hash (``encode_client.rank_replicas``: the replica the proxy handed the image to first, then
the ones it would have failed over to), the next one on a miss or an error; a replica that does
not answer is skipped for ``down_for`` seconds. The whole call is bounded by ``timeout`` seconds.

What comes back is what :meth:`encode_client.store.StoreReader.read_many` returns for a Redis
value, so the caller validates both alike: a :class:`~encode_client.store.StoredEmbedding`, a
:class:`~encode_client.store.CorruptValue` (an answer of another fingerprint, for another hash, or
whose tensor disagrees with its own description), or None (no replica holds it, or none answered).

Tenants: an identifier ``t:{tenant_digest}:{mm_hash}`` (``t:{tenant_digest}:video:{mm_hash}`` for
a video) names a tenant's entry, which encode-server serves only to that tenant's key. ``api_keys``
(encode-server's ``TENANT:KEY`` list) gives the fetcher a key per tenant; an identifier of a tenant
without a key is never asked for (None), and plain identifiers go with ``api_key`` (or a key of the
list without a tenant). An identifier of an item preprocessed under per-request settings
(``p:{settings_digest}:...``) is never asked for (None): a hash-only request names settings by their
values, which the digest does not give back, and without them it would address the default entry.
Never imports torch.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx

from encode_client._base import rank_replicas
from encode_client._callers import Callers
from encode_client.keys import StoredIdentifier, identifier_key, parse_identifier, tenant_digest
from encode_client.safetensors import SafetensorsError, load_safetensors
from encode_client.store import VALUE_DTYPES, CorruptValue, StoredEmbedding

__all__ = ["EncoderFetcher", "parse_fetch_answer"]

_SAFETENSORS = "application/vnd.safetensors"
Outcome = StoredEmbedding | CorruptValue | None


def _split(identifier: str) -> StoredIdentifier:
    """The parts of a stored item's identifier (the connector asks only for those)."""
    parts = parse_identifier(identifier)
    if parts is None:
        raise ValueError(f"{identifier!r} names no stored item")
    return parts


def parse_fetch_answer(blob: bytes, keys: Sequence[str], hashes: Sequence[str], fingerprint: str) -> list[Outcome]:
    """One safetensors answer to a hash-only ``/v1/encode``, item by item, checked like a stored value.

    Every item must be the hash asked for, in order, under ``fingerprint``; a resolved item's
    tensor must exist and agree with its own ``dtype`` and ``shape`` ([N >= 1, D], a float dtype).
    An answer that breaks these for all its items (not safetensors, another fingerprint, other
    hashes) is a :class:`CorruptValue` for each; a ``miss`` is None."""
    try:
        tensors, metadata = load_safetensors(blob)
        items = json.loads(metadata["items"])
        answered = metadata.get("fingerprint")
        if not isinstance(items, list) or [i.get("hash") for i in items] != list(hashes):
            raise ValueError("the answer's items are not the hashes asked for")
        if answered != fingerprint:
            raise ValueError(f"fingerprint {str(answered)[:12]}..., expected {fingerprint[:12]}...")
    except (SafetensorsError, KeyError, TypeError, ValueError, AttributeError) as exc:
        return [CorruptValue(f"{key}: encode-server's answer rejected: {exc}") for key in keys]
    out: list[Outcome] = []
    for key, mm_hash, item in zip(keys, hashes, items, strict=True):
        if item.get("status") == "miss":
            out.append(None)
            continue
        tensor = tensors.get(str(item.get("index")))
        meta = item.get("meta") or {}
        shape = list(tensor.shape) if tensor is not None else None
        if (
            tensor is None
            or tensor.dtype not in VALUE_DTYPES
            or tensor.dtype != item.get("dtype")
            or shape is None
            or len(shape) != 2
            or min(shape) < 1
            or shape != item.get("shape")
            or not isinstance(meta, dict)
        ):
            out.append(CorruptValue(f"{key}: encode-server's tensor does not match its description ({item})"))
            continue
        out.append(StoredEmbedding(key, mm_hash, fingerprint, tensor.dtype, tensor.shape, tensor.data, meta))
    return out


class EncoderFetcher:
    """Hash-only fetches from encode-server replicas (see the module docstring).

    ``counts``: ``requests``, ``hit``, ``miss``, ``corrupt``, ``error`` (a replica that did not
    answer, or answered with an error status), ``no_key`` (a tenant's identifier without its key),
    ``settings`` (an identifier of per-request settings: never asked), ``timeout`` (items left when the time was up)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        fingerprint: str,
        api_key: str | None = None,
        api_keys: str | None = None,
        prefix: str = "encode",
        timeout: float = 2.0,
        down_for: float = 5.0,
    ) -> None:
        if not urls:
            raise ValueError("EncoderFetcher needs at least one encode-server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.fingerprint = fingerprint
        self.prefix = prefix
        self.timeout = timeout
        self.down_for = down_for
        self._plain_key = api_key
        self._tenant_keys: dict[str, str] = {}
        for caller in Callers(api_keys) if api_keys else ():
            if caller.tenant is None:
                self._plain_key = self._plain_key or caller.key
            else:
                self._tenant_keys[tenant_digest(caller.tenant)] = caller.key
        self._down: dict[str, float] = {}
        self._http = httpx.Client(timeout=timeout)
        self.counts: Counter[str] = Counter()

    def close(self) -> None:
        self._http.close()

    def _key_for(self, digest: str | None) -> tuple[bool, str | None]:
        """(may ask, the API key to ask with) for a tenant digest (None: no tenant)."""
        if digest is None:
            return True, self._plain_key
        key = self._tenant_keys.get(digest)
        return key is not None, key

    def fetch_many(self, identifiers: Sequence[str]) -> dict[str, Outcome]:
        """Each identifier's embedding from the first replica, in rendezvous order, that holds it."""
        deadline = time.monotonic() + self.timeout
        out: dict[str, Outcome] = {i: None for i in identifiers}
        # identifier -> (API key, replicas still to ask, in order)
        todo: dict[str, tuple[str | None, list[str]]] = {}
        for identifier in identifiers:
            digest, _, mm_hash, settings = _split(identifier)
            if settings is not None:  # the server takes settings by value, never by digest: unaskable
                self.counts["settings"] += 1
                continue
            allowed, key = self._key_for(digest)
            if not allowed:
                self.counts["no_key"] += 1
                continue
            now = time.monotonic()
            ranked = [r for r in rank_replicas(mm_hash, self.urls) if self._down.get(r, 0.0) <= now]
            if ranked:
                todo[identifier] = (key, ranked)
            else:
                self.counts["error"] += 1
        while todo:
            if time.monotonic() >= deadline:
                self.counts["timeout"] += len(todo)
                break
            groups: dict[tuple[str, str | None], list[str]] = {}
            for identifier, (key, replicas) in todo.items():
                groups.setdefault((replicas[0], key), []).append(identifier)
            for (replica, key), group in groups.items():
                answers = self._ask(replica, key, group, deadline)
                for identifier in group:
                    answer = answers.get(identifier) if answers is not None else None
                    if answer is not None:
                        out[identifier] = answer
                        # a corrupt answer from one replica: another may still hold a good value
                        if isinstance(answer, StoredEmbedding):
                            del todo[identifier]
                            continue
                    todo[identifier][1].pop(0)
                    if not todo[identifier][1]:
                        del todo[identifier]
        return out

    def _ask(self, replica: str, key: str | None, identifiers: list[str], deadline: float) -> dict[str, Outcome] | None:
        """One hash-only request to ``replica``; None when it did not answer usefully."""
        parts = [_split(i) for i in identifiers]
        hashes = [p.mm_hash for p in parts]
        keys = [identifier_key(self.fingerprint, i, prefix=self.prefix) or i for i in identifiers]
        headers = {"Accept": _SAFETENSORS}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # "modality" only for a video, so an image's item is what it always was (as the client sends it)
        body: dict[str, Any] = {
            "items": [{"hash": p.mm_hash, **({"modality": p.modality} if p.modality != "image" else {})} for p in parts]
        }
        self.counts["requests"] += 1
        try:
            timeout = max(0.001, deadline - time.monotonic())
            r = self._http.post(replica + "/v1/encode", json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError:
            self._down[replica] = time.monotonic() + self.down_for
            self.counts["error"] += 1
            return None
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith(_SAFETENSORS):
            self.counts["error"] += 1
            return None
        answers = parse_fetch_answer(r.content, keys, hashes, self.fingerprint)
        for answer in answers:
            self.counts["miss" if answer is None else "corrupt" if isinstance(answer, CorruptValue) else "hit"] += 1
        return dict(zip(identifiers, answers, strict=True))
