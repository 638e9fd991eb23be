"""What a model family is, declared once per family module and asked by everything else.

A family module (``qwen.py``, ``llava.py``, ``clip.py``, ...) ends with a ``FAMILY`` (or several)
saying which ``model_type`` values it serves, how a checkpoint of it loads (the loader builds the
``Encoder`` that preprocesses, encodes and counts tokens), which modalities it takes, and how
a vLLM prefill worker consumes its embeddings (``Epd``). ``encoders/__init__.py`` builds its
``model_type`` table from the families; the server publishes the family and its EPD contract in
``GET /v1/model``, so the connector and the proxy (``encode_client``, which never imports the
server) read it from there instead of keeping their own copy.

Invariants (checked by ``tests/unit/encoders/test_family.py``): every ``model_type`` belongs to
one family; a pixel-free family names, for each modality it takes, the metadata fields a
pixel-free item carries, and every one of them is a key of the ``meta`` its encoder emits; a
family whose modalities vLLM takes in different modes (Qwen3-Omni: audio pixel-free, images and
videos pixels + uuid) says so per modality (``Epd.modes``), and names fields only for its
pixel-free ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from encode_client.epd_contract import EPD_MODES, PER_MODALITY  # the client reads what it defines
from encode_client.epd_tensor import DTYPES as TENSOR_DTYPES  # what the proxy can write

from encode_server.core.settings import Setting
from encode_server.core.sglang_wire import SglangContract

__all__ = ["EPD_MODES", "PER_MODALITY", "TENSOR_DTYPES", "Epd", "Family", "by_model_type"]


@dataclass(frozen=True)
class Epd:
    """How vLLM takes this family's embeddings from an E: vLLM's decision, read from its model file.

    - ``pixel_free``: the prefill request carries no pixels, only ``fields`` (per modality, the
      metadata vLLM's multimodal parser declares as ``embedding_fields``) and the ``uuid``; the
      prefill worker can run without its tower.
    - ``pixels_uuid``: the prefill request carries the image (vLLM's processor sizes the
      placeholder from it) and the ``uuid``; its EC connector supplies the embedding, so the tower
      is never run (it stays loaded).

    ``tensors`` (per modality, field -> dtype) names the metadata vLLM's processor takes as a
    tensor but its parser does not declare: vLLM's chat parser refuses a JSON array for such a key
    but loads a string as a serialised tensor, so the proxy sends each as one, in the dtype vLLM's
    own processor gives it (Qwen2.5-VL's seconds per temporal group: float32, in ``qwen.py``). Sent
    when the item's ``meta`` has the key (Qwen2-VL's has none), never required.

    ``modes`` (per modality) overrides ``mode`` where vLLM decides otherwise for that modality
    (Qwen3-Omni's thinker: ``mode`` pixels + uuid for its images and videos, ``modes`` audio
    pixel-free). ``fields`` then names exactly the pixel-free modalities' metadata.

    ``alone``: the pixel-free modalities vLLM takes metadata-only only in a request with no pixels +
    uuid item; beside one, such an item goes as its file + uuid (vLLM's processor then runs on it,
    its tower does not). Qwen3-Omni's audio in vLLM 0.32: its processor builds the text it hands
    the HF processor from every item's count, a metadata-only one's included, so a request with
    metadata-only audio and an image fails there (``tests/vllm/test_qwen3_omni.py``).

    ``audio_in_video``: vLLM takes the request's ``use_audio_in_video`` (the Omni thinkers: each
    video's own sound, its rows interleaved with the video's in one placeholder). Its chat parser
    takes a video's sound only from the video's file, so in such a request every item goes as its
    file + uuid, and each video is two items, the video and its sound (the same bytes as an audio
    item), each encoded here as any other.
    """

    mode: Literal["pixel_free", "pixels_uuid"]
    fields: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    vllm_model: str = ""  # vLLM's model file that decides it, e.g. "qwen2_5_vl.py"
    tensors: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    modes: Mapping[str, Literal["pixel_free", "pixels_uuid"]] = field(default_factory=dict)
    alone: tuple[str, ...] = ()
    audio_in_video: bool = False

    def __post_init__(self) -> None:
        for mode in (self.mode, *self.modes.values()):
            if mode not in EPD_MODES:
                raise ValueError(f"EPD mode must be one of {EPD_MODES}, not {mode!r}")
        if self.mode == "pixel_free" and not self.fields:
            raise ValueError("a pixel-free family must name the fields its prefill items carry")
        for modality, mode in self.modes.items():
            if mode == "pixel_free" and not self.fields.get(modality):
                raise ValueError(f"a pixel-free {modality} must name the fields its prefill items carry")
        if self.modes and (stray := [m for m in self.fields if self.mode_of(m) != "pixel_free"]):
            raise ValueError(f"fields are named for {stray}, which this contract takes as pixels + uuid")
        if stray := [m for m in self.alone if self.mode_of(m) != "pixel_free"]:
            raise ValueError(f"only a pixel-free modality can be pixel-free alone, not {stray}")
        for modality, named in self.tensors.items():
            if set(named) & set(self.fields.get(modality, ())):
                raise ValueError(f"a {modality} field is declared both as JSON and as a tensor")
            if not set(named.values()) <= set(TENSOR_DTYPES):
                raise ValueError(f"tensor fields must be one of {TENSOR_DTYPES}, not {dict(named)}")

    def mode_of(self, modality: str) -> str:
        """The mode vLLM takes ``modality``'s items in."""
        return self.modes.get(modality, self.mode)

    @property
    def per_modality(self) -> bool:
        """Whether the modalities differ in mode."""
        return any(mode != self.mode for mode in self.modes.values())

    def describe(self, modalities: Sequence[str] = ()) -> dict[str, Any]:
        """The JSON form ``GET /v1/model`` publishes (``epd``). A family of one mode publishes it
        as it always has; one whose modalities differ publishes ``mode`` ``per_modality`` and
        ``modes``, each of ``modalities`` (the family's) and its mode."""
        fields = {modality: list(names) for modality, names in self.fields.items()}
        tensors = {modality: dict(named) for modality, named in self.tensors.items()}
        described: dict[str, Any] = {"mode": self.mode, "fields": fields, "tensors": tensors,
                                     "vllm_model": self.vllm_model}
        if self.per_modality:
            named = list(dict.fromkeys([*modalities, *self.modes]))
            described.update(mode=PER_MODALITY, modes={m: self.mode_of(m) for m in named})
        if self.alone:
            described["pixel_free_alone"] = list(self.alone)
        if self.audio_in_video:
            described["audio_in_video"] = True
        return described


@dataclass(frozen=True)
class Family:
    """One model family: its ``model_type`` values, its loader, its modalities and its EPD contract.

    ``load(files, config, processor, spec)`` returns the family's ``Encoder``; ``epd`` is None
    for a family no vLLM prefill consumes through the EPD path (yet, or ever: a retrieval tower).
    ``settings``: the keys of vLLM's per-request ``mm_processor_kwargs`` this family's encoder
    applies (its ``setting_defaults``, ``preprocess_with`` and ``count_tokens_with``), in vLLM's
    names; a request naming any other key is refused, never silently preprocessed the default way.
    ``modalities``: what its items may be (``image``, ``video``, ``audio``); any other is refused.
    ``sglang``: how SGLang's language-only prefill takes its embeddings (``--sglang``); None for a
    family SGLang's encoder disaggregation does not take.
    """

    name: str
    model_types: tuple[str, ...]
    load: Callable[..., Any]
    modalities: tuple[str, ...] = ("image",)
    epd: Epd | None = None
    settings: tuple[Setting, ...] = ()
    # How the checkpoint's preprocessor loads from its directory; None: its image processor
    # (``AutoImageProcessor``). An audio family loads its feature extractor.
    processor: Callable[[Any], Any] | None = None
    sglang: SglangContract | None = None

    def describe(self) -> dict[str, Any]:
        settings = {s.name: {"type": s.kind, "modalities": list(s.modalities), "meaning": s.meaning}
                    for s in self.settings}
        return {"name": self.name, "modalities": list(self.modalities),
                "epd": self.epd.describe(self.modalities) if self.epd else None, "settings": settings}


def by_model_type(families: Sequence[Family]) -> dict[str, Family]:
    """The ``model_type`` table, refusing a type claimed by two families."""
    table: dict[str, Family] = {}
    for family in families:
        for model_type in family.model_types:
            if model_type in table:
                raise ValueError(f"model_type {model_type!r} is claimed by {table[model_type].name} and {family.name}")
            table[model_type] = family
    return table
