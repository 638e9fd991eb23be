"""The chat's checks: what the EPD rewrite refuses before anything is handed off, and the plan of
what it hands off (``ChatPlan``). No I/O; docs/epd-proxy.md states the rules for operators."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from encode_client.epd_contract import MEDIA_IO_FIELD, PER_MODALITY, SETTINGS_FIELD, EpdContract, EPDError

__all__ = [
    "AUDIO_IN_VIDEO",
    "AUDIO_PARTS",
    "EMBEDS_PARTS",
    "IMAGE_PARTS",
    "REFUSED_FIELDS",
    "VIDEO_PARTS",
    "ChatPlan",
    "EmbedsPart",
    "MediaPart",
    "audio_in_video",
    "check_chat_request",
    "check_contract",
    "check_request_fields",
    "find_image_parts",
    "video_settings",
]

IMAGE_PARTS = frozenset({"image_url", "input_image"})
VIDEO_PARTS = frozenset({"video_url"})
AUDIO_PARTS = frozenset({"audio_url", "input_audio"})
EMBEDS_PARTS = frozenset({"image_embeds", "video_embeds", "audio_embeds"})
AUDIO_IN_VIDEO = "use_audio_in_video"  # vLLM's key for the Omni thinkers' video with its own sound
REFUSED_FIELDS: dict[str, str] = {
    SETTINGS_FIELD: "per-request processor settings are off on this proxy (start it with --trust-request-mm-kwargs, "
    "and encode-server with its flag of that name, to take them)",
    MEDIA_IO_FIELD: "per-request media loading settings (a video's fps) are off on this proxy (start it with "
    "--trust-request-mm-kwargs, and encode-server with its flag of that name, to take them)",
    "kv_transfer_params": "it steers vLLM's KV transfer connector, which only the serving system may do",
    "ec_transfer_params": "it steers vLLM's encoder-cache connector, which only the serving system may do",
}


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
    """Check ``body``; the parts the rewrite replaces. vLLM keeps what it computed for an item under
    the item's ``uuid`` for every later request naming it, so no client may name an item: a part
    with a ``uuid`` is refused, whatever its type; an embeddings part unless ``trust_client_embeds``
    (then re-keyed by its payload's hash); a part without a string ``type`` (vLLM guesses its kind);
    a URL that is not ``data:`` (the proxy fetches nothing); and the fields of ``REFUSED_FIELDS``
    (``mm_processor_kwargs`` and ``media_io_kwargs.video`` taken when ``trust_request_mm_kwargs``).
    Each refusal is an ``EPDError`` naming the part or the field."""
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

