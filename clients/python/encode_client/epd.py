"""The EPD request path: an OpenAI chat-completions request with images, videos and audio, rewritten for a
prefill worker that takes their embeddings from encode-server (an EC consumer, see
``encode_client.vllm_connector``).

Every image part (``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``, or
the Responses form ``{"type": "input_image", "image_url": "data:..."}``) is handed to encode-server
first (hash only; the bytes go only for images no tier holds), with ``"return": "metadata"``, so
that its embedding is in the shared tier when the request leaves; the part is then rewritten in
the EPD mode of the family encode-server serves (``GET /v1/model``'s ``family.epd``, read by
``EpdContract``: vLLM's decision per family) and named by the identifier of the image's store key
(``encode_client.keys``: the ``mm_hash``, or ``t:{tenant_digest}:{mm_hash}`` for a tenant):

- ``pixel_free`` (Qwen2-VL, Qwen2.5-VL): a metadata-only embeddings part carrying exactly the
  fields the family declares; the prefill worker sees no pixels, vLLM sizes the placeholder from
  the metadata::

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 16, 22]}, "uuid": "<identifier>"}

- ``pixels_uuid`` (InternVL, Gemma 3, ...: vLLM takes no metadata-only item for them): the image
  part itself, with the identifier added; vLLM's processor sizes the placeholder from the pixels::

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}, "uuid": "<identifier>"}

Either way vLLM asks its EC connector for the identifier, which reads the embedding from the shared
tier, and its own tower does not run for the image.

Every video part (``{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}``) is
handed off the same way, as a video item (one file, one item, one ``mm_hash``, its sampled frames'
rows), each video in a call of its own (so an error names its part), and becomes the family's
pixel-free video part, with exactly the fields its contract declares for ``video`` (Qwen3-VL's
parser: ``video_grid_thw`` and ``timestamps``)::

    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4], "timestamps": [0.25, 1.25]},
     "uuid": "<identifier>"}

A field the contract names under ``tensors`` (metadata vLLM's processor takes but its parser does not
declare, so its chat parser refuses it as a JSON array: Qwen2.5-VL's ``second_per_grid_ts``) goes
as a tensor string (``encode_client.epd_tensor``), built from encode-server's ``meta`` alone, when
the item's ``meta`` has it::

    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4], "second_per_grid_ts": "k05VTVBZ..."},
     "uuid": "<identifier>"}

Every audio part (``{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}``, or
OpenAI's ``{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}``) is
handed off the same way, as an audio item, each in a call of its own, and becomes the family's
pixel-free audio part (Qwen2-Audio's parser: ``audio_num_tokens``)::

    {"type": "audio_embeds", "audio_embeds": {"audio_num_tokens": 92}, "uuid": "<identifier>"}

A family whose modalities vLLM takes in different modes publishes ``mode`` ``per_modality`` and
``modes`` (Qwen3-Omni's thinker: ``{"audio": "pixel_free", "image": "pixels_uuid", "video":
"pixels_uuid"}``): each part is rewritten in its modality's mode, so in one chat its audio becomes
a metadata-only ``audio_embeds`` part and its images and videos keep their pixels with the
identifier added::

    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}, "uuid": "<identifier>"}

(A client older than ``modes`` does not know ``per_modality`` and refuses the contract with
``EpdContractError``: it never sends such a family's items in one mode.) A modality the contract
names in ``pixel_free_alone`` goes metadata-only only in a chat with no pixels + uuid part; beside
one it goes as its file with the identifier added (``{"type": "audio_url", "audio_url": {"url":
"data:audio/wav;base64,..."}, "uuid": "<identifier>"}``, an ``input_audio`` part likewise): vLLM
0.32 fails a Qwen3-Omni request that mixes metadata-only audio with an image or a video.

A chat with ``mm_processor_kwargs.use_audio_in_video`` (trusted only, as vLLM takes it; a family
whose contract declares ``audio_in_video``: the Omni thinkers) has each video's own sound
interleaved with its frames by vLLM. vLLM's chat parser takes the sound only from the video's file,
so every item of such a chat goes as its file with its identifier added (pixels + uuid), each video
is handed off twice (as a video, and its bytes as an audio item: its sound), the key goes on to
vLLM, and, since vLLM hashes every ``uuid`` with the request's ``mm_processor_kwargs``, the
identifiers go too, each modality's in vLLM's item order (a video's sound right after its video),
for the connector to map vLLM's to them::

    "ec_transfer_params": {"encode_server": {"items": {"video": ["video:<mm_hash>"], "audio": ["audio:<mm_hash>"]}}}

A video or audio part for a family whose contract takes no item of its modality (a ``pixels_uuid``
family's video or audio, one that declares no ``video`` / ``audio`` fields, a modality
``modes`` does not name) is refused, naming the part, before anything is handed off: it is never
forwarded with its frames or samples outside the contract. A video or
audio file encode-server refuses (unreadable, too long, a codec its FFmpeg lacks: its 4xx names the
item) is an ``EPDError`` naming the part, with the server's reason.

vLLM keeps what it computed for an item (encoder output, processed inputs, prefix blocks) under
the item's identifier, for every later request that names it. So the rewrite lets no client name
an item (``check_chat_request``; each refusal is an ``EPDError`` naming the part):

- a part carrying a ``uuid``, whatever its type, is refused (vLLM reads a ``uuid`` on any part,
  even on a ``text`` part that also carries an ``image_url``);
- ``image_embeds`` / ``video_embeds`` / ``audio_embeds`` parts are refused, unless the caller is
  trusted (``trust_client_embeds``): then each is named by the content hash of its payload,
  ``e:...``, never the client's ``uuid``, so it is served only to requests that send that payload;
- a part without a string ``type`` is refused (vLLM guesses an untyped part's kind from its keys);
- ``mm_processor_kwargs`` is refused unless the rewrite trusts them (``trust_request_mm_kwargs``,
  the proxy's ``--trust-request-mm-kwargs``, as vLLM's own flag of that name): then they must be the
  served family's keys (``GET /v1/model``'s ``mm_processor_kwargs``: a server that takes them, each
  key of the right type within its bounds), checked before anything is handed off; every item is
  handed off under them, so encode-server preprocesses it so and names it by its bytes *and* the
  settings (``p:{settings_digest}:`` in its identifier: ``encode_client.keys``). They are dropped
  from the body for a ``pixel_free`` family (the metadata already carries the grid they gave). For
  a ``pixels_uuid`` item they stay (vLLM's processor sizes its placeholder from the pixels under
  them), and since vLLM 0.32 then hashes every item's ``uuid`` together with them
  (``ProcessorInputs.get_mm_hashes``), the rewrite lists the identifiers in ``ec_transfer_params``
  as for ``use_audio_in_video`` (below), for the connector to read the entries under them
  (measured: ``tests/vllm/test_proxy_settings.py``).
  ``media_io_kwargs`` likewise, only when trusted and only ``video``'s keys the family declares
  for vLLM's video loader (``vllm_field`` ``media_io_kwargs.video``: the Qwen video families'
  ``fps``), checked before anything moves: every video is handed off under them (with the
  ``mm_processor_kwargs`` that apply to it), and they are dropped from the body, as vLLM sees no
  video (pixel-free: its grid and times are in the metadata). ``kv_transfer_params`` and
  ``ec_transfer_params`` are refused: they steer vLLM's transfer connectors, which only the
  serving system may do.

Only ``data:`` URLs are accepted, for images, videos and audio: fetching ``http(s)://`` URLs would make the
proxy an open fetcher (SSRF), so such a part is refused with a clear error naming it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import inspect
import json
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from blake3 import blake3

from encode_client._base import BaseClient, Flow
from encode_client._client import AsyncClient, Client
from encode_client._errors import ServerError
from encode_client._images import mm_hash
from encode_client._types import Result
from encode_client.epd_tensor import DTYPES as TENSOR_DTYPES
from encode_client.epd_tensor import tensor_string
from encode_client.keys import EC_PARAMS_KEY, embeds_identifier, epd_identifier, own_identifier

__all__ = [
    "AUDIO_IN_VIDEO",
    "AUDIO_PARTS",
    "EMBEDS_PARTS",
    "IMAGE_PARTS",
    "MEDIA_IO_FIELD",
    "REFUSED_FIELDS",
    "SETTINGS_FIELD",
    "VIDEO_PARTS",
    "ChatPlan",
    "EPDError",
    "EmbedsPart",
    "EpdContract",
    "EpdContractError",
    "MediaPart",
    "apply_results",
    "audio_in_video",
    "cache_salt",
    "check_chat_request",
    "check_contract",
    "check_request_fields",
    "find_image_parts",
    "rewrite_chat_plan",
    "rewrite_chat_plan_async",
    "rewrite_chat_request",
    "rewrite_chat_request_async",
    "video_settings",
]

IMAGE_PARTS = frozenset({"image_url", "input_image"})
VIDEO_PARTS = frozenset({"video_url"})
AUDIO_PARTS = frozenset({"audio_url", "input_audio"})
EMBEDS_PARTS = frozenset({"image_embeds", "video_embeds", "audio_embeds"})
SETTINGS_FIELD = "mm_processor_kwargs"
MEDIA_IO_FIELD = "media_io_kwargs"
AUDIO_IN_VIDEO = "use_audio_in_video"  # vLLM's key for the Omni thinkers' video with its own sound
EC_PARAMS_FIELD = "ec_transfer_params"
REFUSED_FIELDS: dict[str, str] = {
    SETTINGS_FIELD: "per-request processor settings are off on this proxy (start it with --trust-request-mm-kwargs, "
    "and encode-server with its flag of that name, to take them)",
    MEDIA_IO_FIELD: "per-request media loading settings (a video's fps) are off on this proxy (start it with "
    "--trust-request-mm-kwargs, and encode-server with its flag of that name, to take them)",
    "kv_transfer_params": "it steers vLLM's KV transfer connector, which only the serving system may do",
    "ec_transfer_params": "it steers vLLM's encoder-cache connector, which only the serving system may do",
}
_SALT_DOMAIN = "encode-server/epd/cache-salt/v1"
EPD_MODES = ("pixel_free", "pixels_uuid")
PER_MODALITY = "per_modality"  # GET /v1/model's epd.mode when the family's modalities differ (``modes``)


class EPDError(ValueError):
    """A request the EPD path cannot rewrite; ``where`` names the part (``messages[1].content[0]``)
    or the field (``mm_processor_kwargs``)."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


class EpdContractError(RuntimeError):
    """encode-server's model cannot be consumed through the EPD path (no family, or a family no vLLM
    prefill consumes): a deployment error, not the request's."""


@dataclass(frozen=True)
class EpdContract:
    """How a vLLM prefill takes the served family's images: ``GET /v1/model``'s ``family.epd``.

    ``mode`` is ``pixel_free`` (``fields``: per modality, the metadata keys a metadata-only item
    carries as JSON; ``tensors``: those it carries as tensor strings, with their dtype),
    ``pixels_uuid`` (the image stays in the request, with its identifier), or ``per_modality``
    (``modes``: each modality's own, one of those two). ``mode_of`` says how a modality's items go."""

    mode: str
    fields: Mapping[str, tuple[str, ...]]
    tensors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # GET /v1/model's mm_processor_kwargs: whether the server takes them, and each key's description
    settings_enabled: bool = False
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    modes: Mapping[str, str] = field(default_factory=dict)  # per_modality's: modality -> its mode
    # pixel-free modalities vLLM takes metadata-only only in a request with no pixels + uuid item
    pixel_free_alone: frozenset[str] = frozenset()
    audio_in_video: bool = False  # the family takes use_audio_in_video (its chat: every item as file + uuid)

    def modes_for(self, modalities: set[str], audio_in_video: bool = False) -> dict[str, str | None]:
        """Each of a request's ``modalities`` and the mode its items go in, in that request: a
        ``pixel_free_alone`` one as pixels + uuid when another goes so; every one as pixels + uuid
        in a request with ``use_audio_in_video`` (vLLM's chat parser takes a video's sound only from
        the video's file, and a metadata-only item beside it is what vLLM 0.32 fails for Qwen3-Omni)."""
        modes = {m: self.mode_of(m) for m in modalities}
        if audio_in_video:
            return {m: "pixels_uuid" if mode is not None else None for m, mode in modes.items()}
        if "pixels_uuid" in modes.values():
            modes.update({m: "pixels_uuid" for m in modes if m in self.pixel_free_alone and modes[m] == "pixel_free"})
        return modes

    def mode_of(self, modality: str) -> str | None:
        """How ``modality``'s items reach vLLM: ``pixel_free``, ``pixels_uuid``, or None where the
        contract takes none (a pixel-free family's modality without fields; a pixels + uuid
        family's anything but images; a modality ``modes`` does not name)."""
        if self.mode == PER_MODALITY:
            return self.modes.get(modality)
        if self.mode == "pixels_uuid":
            return "pixels_uuid" if modality == "image" else None
        return "pixel_free" if self.fields.get(modality) else None

    @classmethod
    def from_model(cls, model: Mapping[str, Any]) -> EpdContract:
        family = model.get("family")
        if not isinstance(family, Mapping):
            raise EpdContractError("encode-server's GET /v1/model names no model family (a server older than families)")
        epd = family.get("epd")
        if not isinstance(epd, Mapping):
            raise EpdContractError(
                f"encode-server serves {model.get('id')} (family {family.get('name')}), which no vLLM prefill "
                "consumes through the EPD path"
            )
        mode, fields = epd.get("mode"), epd.get("fields") or {}
        if mode not in (*EPD_MODES, PER_MODALITY) or not isinstance(fields, Mapping):
            raise EpdContractError(f"encode-server's EPD contract is not one this client knows: {dict(epd)}")
        if mode == "pixel_free" and not any(fields.values()):
            raise EpdContractError("encode-server's pixel-free contract names no fields")
        modes = epd.get("modes") or {} if mode == PER_MODALITY else {}
        if mode == PER_MODALITY and (not modes or not isinstance(modes, Mapping)
                                     or not all(m in EPD_MODES for m in modes.values())):
            raise EpdContractError(f"encode-server's per-modality EPD contract has modes this client does not "
                                   f"know: {epd.get('modes')}")
        if bare := [m for m, each in modes.items() if each == "pixel_free" and not fields.get(m)]:
            raise EpdContractError(f"encode-server's per-modality contract names no fields for pixel-free {bare}")
        tensors = epd.get("tensors") or {}  # a server older than tensor fields publishes none
        if not isinstance(tensors, Mapping) or not all(
            isinstance(named, Mapping) and all(dtype in TENSOR_DTYPES for dtype in named.values())
            for named in tensors.values()
        ):
            raise EpdContractError(
                f"encode-server's EPD contract has tensor fields this client cannot write: {tensors}"
            )
        published = model.get("mm_processor_kwargs")  # a server older than settings publishes none
        published = published if isinstance(published, Mapping) else {}
        keys = published.get("keys")
        keys = keys if isinstance(keys, Mapping) else {}
        return cls(
            str(mode),
            {str(m): tuple(str(f) for f in names) for m, names in fields.items()},
            {str(m): {str(f): str(d) for f, d in named.items()} for m, named in tensors.items()},
            published.get("enabled") is True,
            {str(k): dict(v) for k, v in keys.items() if isinstance(v, Mapping)},
            {str(m): str(each) for m, each in modes.items()},
            frozenset(str(m) for m in epd.get("pixel_free_alone") or ()),
            epd.get("audio_in_video") is True,
        )

    def check_settings(self, settings: Mapping[str, Any], modalities: set[str], field: str = SETTINGS_FIELD) -> None:
        """Refuse ``settings`` the served family would refuse (the server checks again): a server
        that takes none, an unknown key, a key vLLM takes in another field than ``field``
        (``mm_processor_kwargs``, or ``media_io_kwargs.video``: each key's ``vllm_field``), one that
        does not apply to a modality the request sends, a wrong type, a value out of bounds. Raises
        ``EPDError`` naming the key."""
        if not self.settings_enabled:
            raise EPDError("encode-server takes no per-request processor settings (start it with "
                           "--trust-request-mm-kwargs)", field)
        keys = {k: d for k, d in self.settings.items() if d.get("vllm_field", SETTINGS_FIELD) == field}
        for name, value in settings.items():
            where = f"{field}.{name}"
            declared = keys.get(name)
            if declared is None:
                if name in self.settings:
                    other_field = self.settings[name].get("vllm_field", SETTINGS_FIELD)
                    raise EPDError(f"vLLM takes this setting in {other_field}, not here", where)
                raise EPDError(f"not a setting of the served family here (its keys: {', '.join(keys) or 'none'})",
                               where)
            if other := modalities - set(declared.get("modalities") or ()):
                raise EPDError(f"does not apply to a {sorted(other)[0]}, and the request has one", where)
            kind = declared.get("type")
            ok = (isinstance(value, bool) if kind == "bool" else not isinstance(value, bool) and (
                isinstance(value, int) if kind == "int" else isinstance(value, (int, float))))
            if not ok:
                raise EPDError(f"must be of type {kind}, got {type(value).__name__}", where)
            low, high, above = declared.get("minimum"), declared.get("maximum"), declared.get("exclusive_minimum")
            if kind != "bool" and ((low is not None and value < low) or (high is not None and value > high)
                                   or (above is not None and value <= above) or value != value):
                bounds = f"({above}, {high}]" if above is not None else f"[{low}, {high}]"
                raise EPDError(f"must be within {bounds}, got {value!r}", where)


@dataclass(frozen=True)
class MediaPart:
    """An image, video or audio part, its file decoded from its data: URL (or ``input_audio``'s data)."""

    message: int
    part: int
    data: bytes
    kind: str = "image_url"  # or the Responses form, "input_image", or "video_url", "audio_url", "input_audio"
    url: str = ""  # the data: URL, as the client sent it
    format: str = ""  # an input_audio part's "format", as the client sent it
    sound: bool = False  # a video part's own sound (use_audio_in_video): its bytes as an audio item

    @property
    def where(self) -> str:
        return _where(self.message, self.part)

    @property
    def modality(self) -> str:
        if self.sound:
            return "audio"
        return "video" if self.kind in VIDEO_PARTS else "audio" if self.kind in AUDIO_PARTS else "image"


@dataclass(frozen=True)
class EmbedsPart:
    """A trusted caller's embeddings part: its type and payload, re-keyed by content."""

    message: int
    part: int
    type: str
    payload: Any


@dataclass(frozen=True)
class ChatPlan:
    """What the rewrite will do: the images, videos and audio to hand off, the trusted embeddings to re-key."""

    images: list[MediaPart]
    embeds: list[EmbedsPart]
    videos: list[MediaPart] = field(default_factory=list)
    settings: Mapping[str, Any] | None = None  # the body's mm_processor_kwargs, when trusted and given
    video_settings: Mapping[str, Any] | None = None  # the body's media_io_kwargs.video, likewise
    audios: list[MediaPart] = field(default_factory=list)
    audio_in_video: bool = False  # the body's use_audio_in_video, with a video to apply it to

    @property
    def sounds(self) -> list[MediaPart]:
        """Each video's own sound under ``use_audio_in_video``: the video's bytes as an audio item."""
        return [replace(v, sound=True) for v in self.videos] if self.audio_in_video else []

    @property
    def media(self) -> list[MediaPart]:
        """Every item to hand off, images, videos, audio, then the videos' sounds: the order of the
        rewrite's results."""
        return [*self.images, *self.videos, *self.audios, *self.sounds]


def _where(message: int, part: int) -> str:
    return f"messages[{message}].content[{part}]"


def _data_url_bytes(url: object, where: str, modality: str = "image") -> bytes:
    if not isinstance(url, str):
        raise EPDError(f"{modality}_url.url must be a string", where)
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a relative URL"
        raise EPDError(f"only data: URLs are accepted (the proxy fetches nothing), got {scheme}", where)
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        example = {"video": "data:video/mp4;base64,...", "audio": "data:audio/wav;base64,..."}.get(
            modality, "data:image/png;base64,...")
        raise EPDError(f"a data: URL must be base64 ({example})", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise EPDError("the data: URL's payload is not valid base64", where) from None


def check_request_fields(body: Mapping[str, Any], *, trust_request_mm_kwargs: bool = False) -> Mapping[str, Any] | None:
    """Refuse the body fields in :data:`REFUSED_FIELDS` (set to anything but null or ``{}``), but
    ``mm_processor_kwargs`` and ``media_io_kwargs`` when trusted: then the settings the first gives
    (an object), or None (``video_settings``: the second's)."""
    for name, why in REFUSED_FIELDS.items():
        if name in (SETTINGS_FIELD, MEDIA_IO_FIELD) and trust_request_mm_kwargs:
            continue
        if body.get(name) not in (None, {}):
            raise EPDError(f"refused: {why}", name)
    settings = _item_settings(body) if trust_request_mm_kwargs else None
    if settings is not None and not isinstance(settings, Mapping):
        raise EPDError(f"must be an object, got {type(settings).__name__}", SETTINGS_FIELD)
    return settings or None


def _item_settings(body: Mapping[str, Any]) -> Any:
    """The body's ``mm_processor_kwargs`` but ``use_audio_in_video``, which sets the prompt, not an item."""
    given = body.get(SETTINGS_FIELD)
    if isinstance(given, Mapping) and AUDIO_IN_VIDEO in given:
        return {k: v for k, v in given.items() if k != AUDIO_IN_VIDEO}
    return given


def audio_in_video(body: Mapping[str, Any]) -> bool:
    """A trusted body's ``mm_processor_kwargs.use_audio_in_video`` (refused untrusted, as vLLM
    refuses it without its ``--trust-request-mm-kwargs``), where the served family declares it
    (``EpdContract.audio_in_video``). Not one of the server's settings: each video and its sound are
    encoded as they are alone, and vLLM interleaves their rows."""
    given = body.get(SETTINGS_FIELD)
    if not isinstance(given, Mapping) or AUDIO_IN_VIDEO not in given:
        return False
    value = given[AUDIO_IN_VIDEO]
    if not isinstance(value, bool):
        raise EPDError(f"must be a boolean, got {type(value).__name__}", f"{SETTINGS_FIELD}.{AUDIO_IN_VIDEO}")
    return value


def video_settings(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A trusted body's ``media_io_kwargs``: its ``video`` object (None: no field, ``{}``: none
    given; either way nothing for vLLM to refuse once the field is dropped). Another
    modality's loading settings are refused: encode-server decodes every image itself, and no
    family declares an image loader's setting."""
    given = body.get(MEDIA_IO_FIELD)
    if given in (None, {}):
        return None
    if not isinstance(given, Mapping):
        raise EPDError(f"must be an object, got {type(given).__name__}", MEDIA_IO_FIELD)
    for modality, kwargs in given.items():
        where = f"{MEDIA_IO_FIELD}.{modality}"
        if modality != "video":
            raise EPDError("refused: encode-server decodes every image itself; only video's sampling is taken", where)
        if not isinstance(kwargs, Mapping):
            raise EPDError(f"must be an object, got {type(kwargs).__name__}", where)
    return dict(given.get("video") or {})


def check_chat_request(
    body: Mapping[str, Any], *, trust_client_embeds: bool = False, trust_request_mm_kwargs: bool = False
) -> ChatPlan:
    """Check ``body`` against the rules of the module docstring; the parts the rewrite replaces."""
    settings = check_request_fields(body, trust_request_mm_kwargs=trust_request_mm_kwargs)
    video = video_settings(body) if trust_request_mm_kwargs else None
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise EPDError("messages must be a list")
    images: list[MediaPart] = []
    videos: list[MediaPart] = []
    audios: list[MediaPart] = []
    embeds: list[EmbedsPart] = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for p, part in enumerate(content):
            if not isinstance(part, Mapping):
                continue  # a string is text; vLLM refuses anything else
            where, kind = _where(m, p), part.get("type")
            if not isinstance(kind, str):
                raise EPDError(
                    "a content part needs a string 'type' (vLLM guesses an untyped part's kind from its keys)", where
                )
            if kind in EMBEDS_PARTS:
                if not trust_client_embeds:
                    raise EPDError(
                        f"{kind} parts from clients are refused: vLLM would keep this embedding for every request "
                        "naming its identifier (a proxy for trusted callers may allow them: --trust-client-embeds)",
                        where,
                    )
                if part.get(kind) is None:
                    raise EPDError(f"a {kind} part needs its {kind!r} payload", where)
                embeds.append(EmbedsPart(m, p, kind, part[kind]))
            elif "uuid" in part:
                raise EPDError(
                    "a client's uuid is refused: vLLM would serve whatever it caches under it to every request "
                    "naming it; the proxy names every image and video by its bytes",
                    where,
                )
            elif kind in IMAGE_PARTS:
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, Mapping) else image_url
                data = _data_url_bytes(url, where)  # url is a data: URL string from here on
                images.append(MediaPart(m, p, data, kind, str(url)))
            elif kind in VIDEO_PARTS:
                video_url = part.get("video_url")
                url = video_url.get("url") if isinstance(video_url, Mapping) else video_url
                videos.append(MediaPart(m, p, _data_url_bytes(url, where, "video"), kind, str(url)))
            elif kind in AUDIO_PARTS:
                audios.append(_audio_part(m, p, kind, part.get(kind), where))
    with_sound = trust_request_mm_kwargs and audio_in_video(body) and bool(videos)
    return ChatPlan(images, embeds, videos, settings, video, audios, with_sound)


def _audio_part(m: int, p: int, kind: str, payload: object, where: str) -> MediaPart:
    """``audio_url`` (``{"url": "data:audio/...;base64,..."}``) or OpenAI's ``input_audio``
    (``{"data": "<base64>", "format": "wav"}``): the file's bytes."""
    if kind == "audio_url":
        url = payload.get("url") if isinstance(payload, Mapping) else payload
        return MediaPart(m, p, _data_url_bytes(url, where, "audio"), kind, str(url))
    data = payload.get("data") if isinstance(payload, Mapping) else None
    if not isinstance(data, str):
        raise EPDError("input_audio.data must be a base64 string", where)
    fmt = payload.get("format") if isinstance(payload, Mapping) else None
    try:
        return MediaPart(m, p, base64.b64decode(data, validate=True), kind, format=fmt if isinstance(fmt, str) else "")
    except (binascii.Error, ValueError):
        raise EPDError("input_audio.data is not valid base64", where) from None


def check_contract(plan: ChatPlan, contract: EpdContract) -> None:
    """Refuse an item the served family cannot take (``EpdContract.mode_of`` None: a video or audio
    file for a ``pixels_uuid`` family; any item of a modality whose fields a pixel-free contract
    does not name: an image for Qwen2-Audio, audio for a vision family; pixels + uuid audio, whose
    samples this client does not forward): forwarding its frames or samples would have a prefill
    worker run its own tower on them (or fail, tower-free), outside encode-server's cache and bounds.
    Refuse settings the family would refuse (``EpdContract.check_settings``), loading settings on a
    video taken as pixels + uuid (vLLM's loader would sample its file by them: not measured), and
    ``use_audio_in_video`` where the family's contract does not declare it."""
    if plan.audio_in_video and not contract.audio_in_video:
        raise EPDError("not taken through the EPD path for the served family (its contract declares no "
                       "audio_in_video)", f"{SETTINGS_FIELD}.{AUDIO_IN_VIDEO}")
    modes = contract.modes_for({part.modality for part in plan.media}, plan.audio_in_video)
    if plan.video_settings:
        contract.check_settings(plan.video_settings, {"video"} if plan.videos else set(), f"{MEDIA_IO_FIELD}.video")
        if plan.videos and modes["video"] == "pixels_uuid":
            raise EPDError("refused for this family's videos (EPD mode pixels + uuid): vLLM's loader would sample "
                           "the file by them and hash its uuid with them", f"{MEDIA_IO_FIELD}.video")
    if plan.settings:
        contract.check_settings(plan.settings, {part.modality for part in plan.media})
    for part in plan.media:
        mode = modes[part.modality]
        if mode == "pixel_free" or (mode == "pixels_uuid" and part.modality in ("image", "video")):
            continue
        if mode == "pixels_uuid" and (part.modality in contract.pixel_free_alone or plan.audio_in_video):
            continue  # audio beside an image or a video, or in a chat of videos with their sound: its file + uuid
        if mode == "pixels_uuid":
            why = f"its EPD mode for {part.modality} is pixels + uuid, and this client forwards no {part.modality} file"
        elif contract.mode == "pixels_uuid":
            why = "its EPD mode is pixels + uuid (vLLM takes no metadata-only item for it)"
        elif contract.mode == PER_MODALITY:
            why = f"its per-modality EPD contract names no {part.modality} (modes: {dict(contract.modes)})"
        else:
            why = f"its EPD contract declares no pixel-free {part.modality} item"
        raise EPDError(f"the served model takes no {part.modality} through the EPD path: {why}", part.where)


def find_image_parts(body: Mapping[str, Any], *, trust_client_embeds: bool = False) -> list[MediaPart]:
    """The image parts of ``body["messages"]``, decoded, in order (after ``check_chat_request``)."""
    return check_chat_request(body, trust_client_embeds=trust_client_embeds).images


def cache_salt(tenant: str | None, client_salt: object = None) -> str:
    """vLLM's prefix-cache salt for a request of ``tenant`` (None: a caller without one).

    Derived, never the client's: two tenants' requests never share a cached prefix block (which
    would tell one how fast the other's prompt was), and a client's own salt only subdivides its
    tenant's space."""
    canonical = json.dumps([_SALT_DOMAIN, tenant, client_salt], sort_keys=True, separators=(",", ":"))
    return blake3(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _identifier(part: MediaPart, result: Result) -> str:
    """The item's identifier, from the server's key for it. What its ``meta`` must hold is the
    contract's business (``_media_part``): a pixels + uuid family's items (Gemma 3, LLaVA-1.5: a
    fixed row count, no grid) carry none at all."""
    if result.status == "miss":
        raise EPDError(
            f"encode-server holds no embedding for {part.modality} {result.hash} (miss): the hand-off did not store it",
            part.where,
        )
    own = mm_hash(part.data)
    try:
        if result.key is None:
            return own_identifier(own, part.modality)
        return epd_identifier(result.key, own, part.modality)
    except ValueError as exc:
        raise EPDError(f"encode-server's answer does not name this {part.modality}: {exc}", part.where) from None


def _media_part(part: MediaPart, result: Result, contract: EpdContract, mode: str | None) -> dict[str, Any]:
    """The part vLLM gets for one image, video or audio file in ``mode`` (``EpdContract.modes_for``),
    rebuilt from what was checked only (no other key of the client's)."""
    identifier = _identifier(part, result)
    if mode == "pixels_uuid" and part.modality == "image":
        image_url: Any = {"url": part.url} if part.kind == "image_url" else part.url
        return {"type": part.kind, "image_url": image_url, "uuid": identifier}
    if mode == "pixels_uuid" and part.modality == "video":
        return {"type": part.kind, "video_url": {"url": part.url}, "uuid": identifier}
    if mode == "pixels_uuid" and part.modality == "audio":  # check_contract allowed it
        if part.kind == "input_audio":
            payload = {"data": base64.b64encode(part.data).decode(), "format": part.format}
            return {"type": part.kind, "input_audio": payload, "uuid": identifier}
        return {"type": part.kind, "audio_url": {"url": part.url}, "uuid": identifier}
    fields = contract.fields.get(part.modality) or ()
    if mode != "pixel_free" or not fields:  # check_contract refuses these first
        raise EPDError(f"the served model takes no pixel-free {part.modality}", part.where)
    missing = [f for f in fields if f not in result.meta]
    if missing:
        raise EPDError(f"encode-server's metadata for {part.modality} {result.hash} lacks {missing}", part.where)
    payload = {f: result.meta[f] for f in fields}
    for name, dtype in (contract.tensors.get(part.modality) or {}).items():
        if name in result.meta:
            try:
                payload[name] = tensor_string(result.meta[name], dtype)
            except ValueError as exc:
                raise EPDError(f"encode-server's {name} for {part.modality} {result.hash}: {exc}", part.where) from None
    kind = f"{part.modality}_embeds"
    return {"type": kind, kind: payload, "uuid": identifier}


def apply_results(
    body: Mapping[str, Any], plan: ChatPlan, results: list[Result], contract: EpdContract | None
) -> dict[str, Any]:
    """``body`` rewritten from the hand-off's ``results`` (one per ``plan.media``, in order) in the
    served family's EPD mode, and the trusted embeddings re-keyed by content. No I/O; ``body`` is
    not changed."""
    out = copy.deepcopy(dict(body))
    modes = contract.modes_for({p.modality for p in plan.media}, plan.audio_in_video) if contract is not None else {}
    named: list[tuple[tuple[int, int, bool], str, str]] = []  # (where, sound), modality, identifier
    for part, result in zip(plan.media, results, strict=True):
        assert contract is not None  # read whenever there are images or videos
        if part.sound:  # vLLM's chat parser adds it from the video's part, under the video's uuid
            named.append(((part.message, part.part, True), "audio", _identifier(part, result)))
            continue
        rewritten = _media_part(part, result, contract, modes[part.modality])
        out["messages"][part.message]["content"][part.part] = rewritten
        named.append(((part.message, part.part, False), part.modality, rewritten["uuid"]))
    if plan.media:  # pixel-free, the metadata carries their effect; none left (use_audio_in_video false): vLLM's own
        out.pop(SETTINGS_FIELD, None)
    if plan.video_settings is not None:
        out.pop(MEDIA_IO_FIELD, None)  # every video was handed off under them: vLLM loads none
    for e in plan.embeds:  # rebuilt from type and payload only: no other key of the client's goes on
        identifier = embeds_identifier(e.type, e.payload)
        out["messages"][e.message]["content"][e.part] = {"type": e.type, e.type: copy.deepcopy(e.payload),
                                                         "uuid": identifier}
        named.append(((e.message, e.part, False), e.type.removesuffix("_embeds"), identifier))
    kwargs = {**(plan.settings or {}), **({AUDIO_IN_VIDEO: True} if plan.audio_in_video else {})}
    if kwargs and "pixels_uuid" in modes.values():  # vLLM's processor sees a file: it takes them, and hashes
        out[SETTINGS_FIELD] = kwargs  # every uuid with them, so the connector is told which entry each names
        out[EC_PARAMS_FIELD] = {EC_PARAMS_KEY: {"items": _items_in_vllms_order(named)}}
    return out


def _items_in_vllms_order(named: list[tuple[tuple[int, int, bool], str, str]]) -> dict[str, list[str]]:
    """Per modality, the identifiers in the order vLLM's chat parser adds the items (each part in
    turn, a video's sound right after its video). vLLM hashes every uuid with the request's
    ``mm_processor_kwargs``, so its connector is asked for identifiers no store holds; this list,
    sent as ``ec_transfer_params``, names each of them (``encode_client.vllm_connector``)."""
    items: dict[str, list[str]] = {}
    for _, modality, identifier in sorted(named):
        items.setdefault(modality, []).append(identifier)
    return items


def _refused_item(part: MediaPart, exc: ServerError) -> EPDError | ServerError:
    """An image, video or audio file encode-server refused (a 4xx naming the item): the request's fault,
    named by its part. Anything else (overload, no shared tier, a key refused) stays the server's error."""
    if 400 <= exc.status < 500 and exc.index is not None and exc.status not in (401, 403, 409, 429):
        return EPDError(f"encode-server refused this {part.modality}: {exc.status} {exc.type}: {exc.message}",
                        part.where)
    return exc


# -- the rewrite, once: a flow of jobs, driven by the sync and the async rewrite ---------------------

ContractSource = EpdContract | Callable[[], EpdContract | Awaitable[EpdContract]] | None
# A job is a client flow (``BaseClient``'s, no I/O) or the caller's contract callable (a coroutine
# function's awaited by the async driver). A step is the jobs that may run at once: the async driver
# gathers them, the sync one runs them in order; either sends back one outcome per job, its value or
# the exception it raised, so the flow, not the driver, decides which error the rewrite raises.
Job = Flow[Any] | Callable[[], Any]
RewriteFlow = Generator[list[Job], list[Any], tuple[dict[str, Any], list[Result]]]


def _rewrite_flow(body: Mapping[str, Any], plan: ChatPlan, client: BaseClient, contract: ContractSource) -> RewriteFlow:
    """The contract read, its check, the hand-offs (the images in one, each video and each audio file
    in one of its own, all at once) and ``apply_results``. The first failure in ``plan.media`` order
    is raised, an item encode-server refused as an ``EPDError`` naming its part
    (``_refused_item``)."""
    if not plan.media:
        return apply_results(body, plan, [], None), []
    if contract is None:
        (model,) = yield [client._model_flow()]
        contract = EpdContract.from_model(_value(model))
    elif callable(contract):
        (made,) = yield [contract]
        contract = _value(made)
    if not isinstance(contract, EpdContract):
        raise TypeError(f"contract must be an EpdContract or a callable giving one, not {contract!r}")
    check_contract(plan, contract)
    named: list[MediaPart | None] = [None] if plan.images else []  # the images' call: its error's index names one
    settings = plan.settings
    jobs: list[Job] = (
        [client._encode_flow([p.data for p in plan.images], "handoff", "image", settings)] if plan.images else []
    )
    sampled = {**(settings or {}), **(plan.video_settings or {})} or None  # the server's keys never clash
    jobs += [client._encode_flow([v.data], "handoff", "video", sampled) for v in plan.videos]
    jobs += [client._encode_flow([a.data], "handoff", "audio", settings) for a in [*plan.audios, *plan.sounds]]
    outcomes = yield jobs
    results: list[Result] = []
    for part, outcome in zip([*named, *plan.videos, *plan.audios, *plan.sounds], outcomes, strict=True):
        if part is None and isinstance(outcome, ServerError) and outcome.index is not None \
                and 0 <= outcome.index < len(plan.images):
            part = plan.images[outcome.index]  # the images' call: the server's index is the client's
        if part is not None and isinstance(outcome, ServerError):
            raise _refused_item(part, outcome)
        results += _value(outcome)
    return apply_results(body, plan, results, contract), results


def _value(outcome: Any) -> Any:
    """A job's outcome: its value, or the exception it raised, raised here."""
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _drive(flow: RewriteFlow, client: Client) -> tuple[dict[str, Any], list[Result]]:
    """Run ``flow`` with ``client``: each step's jobs in order."""

    def outcome(job: Job) -> Any:
        try:
            return client._run(job) if isinstance(job, Generator) else job()
        except Exception as exc:
            return exc

    try:
        step = next(flow)
        while True:
            step = flow.send([outcome(job) for job in step])
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def _drive_async(flow: RewriteFlow, client: AsyncClient) -> tuple[dict[str, Any], list[Result]]:
    """Run ``flow`` with ``client``: each step's jobs at once."""

    async def outcome(job: Job) -> Any:
        if isinstance(job, Generator):
            return await client._run(job)
        made = job()
        return await made if inspect.isawaitable(made) else made

    try:
        step = next(flow)
        while True:
            step = flow.send(list(await asyncio.gather(*(outcome(job) for job in step), return_exceptions=True)))
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def rewrite_chat_plan(
    body: Mapping[str, Any],
    plan: ChatPlan,
    client: Client,
    *,
    contract: EpdContract | Callable[[], EpdContract] | None = None,
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request`` for a request already checked into ``plan``."""
    return _drive(_rewrite_flow(body, plan, client, contract), client)


def rewrite_chat_request(
    body: Mapping[str, Any],
    client: Client,
    *,
    trust_client_embeds: bool = False,
    contract: EpdContract | Callable[[], EpdContract] | None = None,
    trust_request_mm_kwargs: bool = False,
) -> tuple[dict[str, Any], list[Result]]:
    """``body`` with each image and video part rewritten in the served family's EPD mode (module
    docstring), named by its identifier; ``trust_client_embeds`` lets embeddings parts through,
    re-keyed by content; ``trust_request_mm_kwargs`` takes the body's ``mm_processor_kwargs``
    (checked against the family's keys, every item handed off under them).
    ``contract``: the family's contract, or a callable giving it (the proxy's,
    which reads it once), used only when the request has an image or a video; None: read from
    ``client.model()`` then. The results are the hand-off's, one per ``ChatPlan.media`` (images,
    then videos, each in request order).

    Each image and video is in encode-server's shared tier when this returns (``client.hand_off``;
    the images in one hand-off, each video in one of its own). Raises ``EPDError`` for a part it
    cannot read or refuses (a video encode-server refuses included), ``EpdContractError`` when the
    served model has no EPD contract, and the client's errors (``ServerError``,
    ``ReplicaUnavailable``) when encode-server refuses or does not answer: of several failed
    hand-offs, the first in ``ChatPlan.media`` order. ``body`` is not changed.
    """
    plan = check_chat_request(body, trust_client_embeds=trust_client_embeds,
                              trust_request_mm_kwargs=trust_request_mm_kwargs)
    return rewrite_chat_plan(body, plan, client, contract=contract)


async def rewrite_chat_request_async(
    body: Mapping[str, Any],
    client: AsyncClient,
    *,
    trust_client_embeds: bool = False,
    contract: ContractSource = None,
    trust_request_mm_kwargs: bool = False,
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request`` with an ``AsyncClient``, its hand-offs at once. A callable
    ``contract`` is called in the loop, after the request is checked and only when it has images or
    videos; it may be a coroutine function (the proxy's, which reads the contract from
    encode-server once)."""
    plan = check_chat_request(body, trust_client_embeds=trust_client_embeds,
                              trust_request_mm_kwargs=trust_request_mm_kwargs)
    return await rewrite_chat_plan_async(body, plan, client, contract=contract)


async def rewrite_chat_plan_async(
    body: Mapping[str, Any],
    plan: ChatPlan,
    client: AsyncClient,
    *,
    contract: ContractSource = None,
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request_async`` for a request already checked into ``plan``."""
    return await _drive_async(_rewrite_flow(body, plan, client, contract), client)
