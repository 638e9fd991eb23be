"""Request and response shapes of the HTTP API, for validation and the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = [
    "EncodeItemIn",
    "EncodeRequestIn",
    "EncodeResponseOut",
    "ErrorBody",
    "ErrorOut",
    "ItemOut",
    "LookupItemOut",
    "LookupRequestIn",
    "LookupResponseOut",
    "TokenCountOut",
    "TokensRequestIn",
    "TokensResponseOut",
]


_SETTINGS_DOC = (
    "per-request processor settings in vLLM's names (the keys GET /v1/model's mm_processor_kwargs lists, e.g. "
    '{"max_pixels": 12544}); taken only with --trust-request-mm-kwargs'
)
SettingsIn = dict[str, Any] | None


class EncodeItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hash: str | None = Field(None, description="lowercase hex BLAKE3-256 of the image file's bytes")
    data: str | None = Field(None, description="standard base64 of the image, video or audio file, or a data: URL")
    modality: Literal["image", "video", "audio"] | None = Field(
        None, description="image (default), video (one item, all its frames) or audio (one item, one file); a "
        "data:video/ or data:audio/ URL implies it"
    )
    mm_processor_kwargs: SettingsIn = Field(None, description=_SETTINGS_DOC + "; over the request's, key by key")


class EncodeRequestIn(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    items: list[EncodeItemIn] = Field(..., min_length=1)
    return_: Literal["embeddings", "metadata"] = Field("embeddings", alias="return")
    mm_processor_kwargs: SettingsIn = Field(None, description=_SETTINGS_DOC + "; every item's default")


class ItemOut(BaseModel):
    index: int
    hash: str
    status: Literal["hit", "encoded", "miss"]
    source: Literal["local", "redis", "encoder"] | None
    num_tokens: int | None = None
    shape: list[int] | None = None
    dtype: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)
    key: str | None = Field(None, description='the store key, with "return": "metadata"')
    embedding: str | None = Field(None, description="base64 of the raw little-endian tensor bytes")


class EncodeResponseOut(BaseModel):
    model: str
    fingerprint: str
    items: list[ItemOut]


class LookupRequestIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hashes: list[str] = Field(..., min_length=1)
    modality: Literal["image", "video", "audio"] = Field(
        "image", description="what the hashes are: a file's bytes as a video are another entry than as an image"
    )
    mm_processor_kwargs: SettingsIn = Field(None, description=_SETTINGS_DOC + ": the entries under these settings")


class LookupItemOut(BaseModel):
    hash: str
    cached: bool
    tier: Literal["local", "redis"] | None


class LookupResponseOut(BaseModel):
    items: list[LookupItemOut]


Size = Annotated[list[StrictInt], Field(min_length=2, max_length=2, description="[width, height] in pixels")]


class TokensRequestIn(BaseModel):
    """Exactly one of ``items`` (uploads, as for /v1/encode) and ``sizes``."""

    model_config = ConfigDict(extra="forbid")

    items: list[EncodeItemIn] | None = Field(None, min_length=1)
    sizes: list[Size] | None = Field(None, min_length=1)
    mm_processor_kwargs: SettingsIn = Field(None, description=_SETTINGS_DOC + "; every item's and size's default")


class TokenCountOut(BaseModel):
    index: int
    num_tokens: int
    width: int = Field(..., description="width after EXIF orientation, as the encoder sees it")
    height: int
    meta: dict[str, Any] = Field(
        default_factory=dict, description="what the family's processor says of the item (its grid, ...)"
    )


class TokensResponseOut(BaseModel):
    model: str
    fingerprint: str
    items: list[TokenCountOut]


class ErrorBody(BaseModel):
    type: str = Field(..., description="stable error code, e.g. invalid_image")
    message: str
    index: int | None = Field(None, description="the item that caused it, when one did")


class ErrorOut(BaseModel):
    error: ErrorBody
