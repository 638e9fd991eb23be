"""Domain errors: what went wrong, in the words of the API contract.

Every error carries the contract's ``type`` string and, where one item caused it, that item's
``index``. The front doors (HTTP, gRPC) map the *class* to a status code; nothing here knows about
HTTP.

    EncodeServerError
    ├── BadInput                 400  invalid_json, invalid_base64, invalid_hash, hash_mismatch,
    │                                 invalid_image, unsupported_image, invalid_video, invalid_audio,
    │                                 unsupported_modality (a video for a model that takes images only),
    │                                 invalid_setting (an mm_processor_kwargs key, type or value refused),
    │                                 settings_disabled (mm_processor_kwargs without --trust-request-mm-kwargs),
    │                                 url_refused, fetch_failed (--sglang: an mm_items URL or path refused, or
    │                                 not fetched)
    ├── InvalidRequest           422  invalid_request (body does not match the schema)
    ├── TooLarge                 413  payload_too_large, image_too_large, video_too_large, audio_too_large,
    │                                 too_many_items,
    │                                 value_too_large (metadata hand-off: above --redis-max-value-mb)
    ├── UnsupportedMediaType     415  unsupported_media_type, unsupported_video, unsupported_audio (a codec
    │                                 not decodable)
    ├── Unauthorized             401  unauthorized
    ├── Conflict                 409  no_shared_tier
    ├── Unavailable              503  overloaded, not_ready, shared_tier_unavailable (metadata
    │                                 hand-off with Redis down); all carry ``retry_after`` seconds
    └── Timeout                  504  timeout
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BadInput",
    "Conflict",
    "EncodeServerError",
    "InvalidRequest",
    "Timeout",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
]


class EncodeServerError(Exception):
    """Base class; ``type`` is the stable, documented error code."""

    type: str = "internal"
    # Every type this class is raised with, its default first: the one registry the OpenAPI
    # document's error lists are derived from (a test holds the code's literals to it).
    types: ClassVar[tuple[str, ...]] = ("internal",)

    def __init__(self, message: str, *, type: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if type is not None:
            self.type = type
        self.index = index

    def with_index(self, index: int) -> EncodeServerError:
        """The same error, attributed to another item (a follower of a shared encode)."""
        clone = type(self)(self.message, type=self.type, index=index)
        clone.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("index",)})
        clone.index = index
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}(type={self.type!r}, index={self.index!r}, message={self.message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole (a preprocessing process's refusal): ``__init__`` takes its fields as keywords,
        which the default (``args`` only) would lose."""
        return (_rebuilt, (type(self), self.message, dict(self.__dict__)))


def _rebuilt(cls: type[EncodeServerError], message: str, state: dict[str, Any]) -> EncodeServerError:
    error = cls(message)
    error.__dict__.update(state)
    return error


class BadInput(EncodeServerError):
    type = "invalid_image"
    types = (
        "invalid_image", "invalid_json", "invalid_base64", "invalid_hash",
        "hash_mismatch", "unsupported_image", "invalid_video", "invalid_audio", "unsupported_modality",
        "invalid_setting", "settings_disabled", "url_refused", "fetch_failed",
    )


class InvalidRequest(EncodeServerError):
    type = "invalid_request"
    types = ("invalid_request",)


class TooLarge(EncodeServerError):
    type = "payload_too_large"
    types = ("payload_too_large", "image_too_large", "video_too_large", "audio_too_large", "too_many_items",
             "value_too_large")


class UnsupportedMediaType(EncodeServerError):
    type = "unsupported_media_type"
    types = ("unsupported_media_type", "unsupported_video", "unsupported_audio")


class Unauthorized(EncodeServerError):
    type = "unauthorized"
    types = ("unauthorized",)


class Conflict(EncodeServerError):
    type = "no_shared_tier"
    types = ("no_shared_tier",)


class Unavailable(EncodeServerError):
    type = "overloaded"
    types = ("overloaded", "not_ready", "shared_tier_unavailable")

    def __init__(
        self,
        message: str,
        *,
        type: str | None = None,
        index: int | None = None,
        retry_after: float = 1.0,
    ) -> None:
        super().__init__(message, type=type, index=index)
        self.retry_after = retry_after


class Timeout(EncodeServerError):
    type = "timeout"
    types = ("timeout",)
