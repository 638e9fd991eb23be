"""What every input kind does: prepare an item for the encoder, and count its rows without it.

An item's bytes are one image, one video or one audio file (``core.types.MODALITIES``); each has
one :class:`ItemKind` that reads its header, checks it against the server's limits, charges the
request-memory budget with what decoding it holds, decodes it and hands the family its samples,
and counts its rows for ``/v1/tokens``. The service looks a kind up by the item's modality and
never branches on it, so a new input kind is one class (``kinds/__init__.py``'s ``KINDS``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from encode_server.admission import MemoryCharge
from encode_server.config import Settings
from encode_server.core.errors import InvalidRequest
from encode_server.encoders.base import Encoder, PreparedItem

__all__ = ["ItemKind", "TokenCount"]


@dataclass(frozen=True)
class TokenCount:
    """What one item will cost: ``num_tokens`` rows (for an image or a video, its EXIF-oriented
    ``width`` x ``height``; 0 x 0 for audio) and the ``meta`` the LLM needs beside them."""

    index: int
    width: int
    height: int
    num_tokens: int
    meta: dict[str, Any]


class ItemKind(ABC):
    """One input kind, for one loaded encoder under the server's limits. ``prepare`` and ``count``
    run on the preprocessing threads (they read headers and decode); neither holds state between
    items. ``settings`` is always the item's *effective* per-request settings
    (``core.settings.RequestSettings.effective``), None for the server's defaults."""

    modality: ClassVar[str]
    plural: ClassVar[str]  # in refusals: "takes images only, not videos"

    def __init__(self, encoder: Encoder, settings: Settings, memory: MemoryCharge) -> None:
        self.encoder = encoder
        self.settings = settings
        self.memory = memory

    def close(self) -> None:  # noqa: B027 (most kinds start nothing)
        """What the kind started (worker processes), stopped with the service."""

    @abstractmethod
    def prepare(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> PreparedItem:
        """The item's bytes to model inputs, checked against the limits and decoded within its
        charge to the request-memory budget. Raises the ``EncodeServerError`` naming ``index``
        that a client should see (4xx for bad bytes, 503 ``overloaded`` for a full budget)."""

    @abstractmethod
    def count(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> TokenCount:
        """The item's rows and meta, as ``prepare`` would make them, without the encoder: from
        its header where that says enough."""

    def count_size(self, index: int, size: Sequence[object], settings: Mapping[str, Any] | None) -> TokenCount:
        """The rows of an item of ``size`` (``/v1/tokens``' ``[width, height]``), without its bytes:
        an image's; a kind whose rows depend on more than a size has none to count."""
        raise InvalidRequest(f"a size counts nothing for {self.plural}", index=index)

    def split(self, prepared: PreparedItem, max_cost: int) -> list[PreparedItem]:
        """``prepared`` as the parts the batcher takes, in order (``Encoder.split``): one, unless
        the kind's items can be cut into passes of at most ``max_cost`` patch tokens."""
        return [prepared]
