"""The EPD contract: how a vLLM prefill takes the served family's items, as encode-server publishes it
in ``GET /v1/model``'s ``family.epd`` (docs/epd-proxy.md). The modes are defined here once:
encode-server's families (``encode_server.encoders.family``) import them, as they do the wire format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from encode_client.epd_tensor import DTYPES as TENSOR_DTYPES

__all__ = [
    "EPD_MODES",
    "MEDIA_IO_FIELD",
    "PER_MODALITY",
    "SETTINGS_FIELD",
    "EPDError",
    "EpdContract",
    "EpdContractError",
]

EPD_MODES = ("pixel_free", "pixels_uuid")
# What ``GET /v1/model`` publishes as ``epd.mode`` for a family whose modalities differ in mode: a
# value no client older than per-modality modes knows, so such a client refuses the contract
# (``EpdContractError``) instead of sending an item in the wrong mode.
PER_MODALITY = "per_modality"
SETTINGS_FIELD = "mm_processor_kwargs"  # a request's processor settings, in vLLM's name
MEDIA_IO_FIELD = "media_io_kwargs"  # a request's media loading settings (a video's fps), likewise


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

