"""An image-aware prefix-cache key (seed section 2).

A prefix / radix cache on the prefill side keys KV by token ids, but every image in a prompt is
a run of one placeholder id: two prompts that differ only in their image look identical, and the
cache would serve one image's KV for the other. ``image_aware_ids`` replaces each image's run
with pad ids derived from the image's full 256-bit ``mm_hash`` and the position in the run:

    pad[j] = lo + (word_j mod (hi - lo)),  word_j = 64-bit word j of BLAKE3-XOF(derive_key(CONTEXT), mm_hash)

BLAKE3's output stream depends only on (context, mm_hash), so the ids are the same in every
process and on every machine (no Python ``hash``, no seed). Choose ``[lo, hi)`` outside the
vocabulary (e.g. ``lo = vocab_size``, ``hi = 2**31``) so pads never equal a real token.

Collision bound, with R = hi - lo and M distinct images of N tokens each:
- two different images give the same whole span with probability R**-N per pair, so at most
  M*(M-1)/2 * R**-N over all pairs (birthday bound): with R = 2**31 and N >= 4, below 2**-100 for
  any M up to 2**20;
- a comparison that covers only the first k tokens of a span (a page boundary right after the
  image starts) matches with probability R**-k per pair: M*(M-1)/2 * R**-k. Keep R large.
SGLang's per-item pad repeats one value from a hash truncated to 30 bits across the whole span,
so a whole-span collision is M*(M-1)/2 * 2**-30 however long the span: about 1 in 2 once
M ~ 2**15 images. Here every position adds log2(R) bits, and the full hash is used.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from blake3 import blake3

from encode_client._errors import PrefixKeyError

__all__ = ["CONTEXT", "image_aware_ids", "pad_ids"]

CONTEXT = "encode-client 2025-01 image-aware prefix key v1"
"""BLAKE3 key-derivation context: changing it changes every pad id (a new key space)."""


def _check_hash(mm_hash: str, index: int) -> bytes:
    try:
        raw = bytes.fromhex(mm_hash)
    except (ValueError, TypeError):
        raw = b""
    if len(raw) != 32 or mm_hash != mm_hash.lower():
        raise PrefixKeyError(f"image {index}: mm_hash must be 64 lowercase hex digits, got {mm_hash!r}")
    return raw


def pad_ids(mm_hash: str, num_tokens: int, lo: int, hi: int) -> list[int]:
    """The ``num_tokens`` pad ids for one image, in ``[lo, hi)``."""
    if not 0 <= lo < hi or hi - lo < 2:
        raise PrefixKeyError(f"pad range [lo, hi) must satisfy 0 <= lo and hi - lo >= 2, got [{lo}, {hi})")
    raw = _check_hash(mm_hash, 0)
    if num_tokens < 0:
        raise PrefixKeyError(f"num_tokens must be >= 0, got {num_tokens}")
    stream = blake3(raw, derive_key_context=CONTEXT).digest(length=8 * num_tokens)
    # 64-bit words: the modulo bias is at most R / 2**64.
    words = np.frombuffer(stream, dtype="<u8")
    return [lo + int(w) for w in words % np.uint64(hi - lo)]


def image_aware_ids(
    token_ids: Sequence[int],
    image_token_id: int,
    images: Sequence[tuple[str, int]],
    *,
    lo: int,
    hi: int,
) -> list[int]:
    """``token_ids`` with image k's ``num_tokens`` placeholders replaced by its pad ids.

    ``images`` is ``[(mm_hash, num_tokens), ...]`` in prompt order. Images are matched to the
    placeholder ids left to right, ``num_tokens`` at a time (adjacent images may share one run);
    every placeholder must belong to exactly one image. Raises ``PrefixKeyError`` otherwise.
    """
    ids = list(token_ids)
    out = list(ids)
    pos = 0
    for k, (mm_hash, count) in enumerate(images):
        _check_hash(mm_hash, k)
        if count <= 0:
            raise PrefixKeyError(f"image {k}: num_tokens must be positive, got {count}")
        try:
            start = ids.index(image_token_id, pos)
        except ValueError:
            raise PrefixKeyError(
                f"{len(images)} images given but only {k} placeholder runs found (placeholder id {image_token_id})"
            ) from None
        run = 0
        while start + run < len(ids) and ids[start + run] == image_token_id and run < count:
            run += 1
        if run < count:
            raise PrefixKeyError(
                f"image {k} has {count} tokens but its placeholder run at position {start} has {run}"
            )
        out[start : start + count] = pad_ids(mm_hash, count, lo, hi)
        pos = start + count
    extra = ids[pos:].count(image_token_id)
    if extra:
        raise PrefixKeyError(f"{extra} placeholder tokens after the last image belong to no image")
    return out
