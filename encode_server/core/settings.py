"""Per-request processor settings (vLLM's ``mm_processor_kwargs``, and a video's sampling from its
``media_io_kwargs``): declared, checked, digested.

A family declares the keys its processor and its video loader take per request (``Setting``:
vLLM's name and the request field vLLM reads it from, its type, its bounds and what it means for
that family); the encoder says their defaults (the checkpoint's processor config), or the server
does (``server_default``: a video's ``fps`` is ``--video-fps``); the bounds are capped by the
server's limits (``--max-image-pixels``) and by a default where the family says so (``ceiling``:
Qwen's ``min_pixels`` and ``max_pixels`` never above the checkpoint's own ``max_pixels``,
InternVL's tiles never above its ``max_patches``), so a request can ask for less work than the
defaults, never for more than the warm-up's worst case ran (``warmup.py``: the largest image,
preprocessed under the defaults). A video's ``fps`` may ask for more frames than the default: the
frames it samples are held to the video limits (``--max-video-frames``, ``--max-video-decoded-frames``)
and charged to the memory budget as at the default rate (``kinds.plan_video``).

``resolve`` turns what a request gave into the *effective* settings: every declared key, the
request's value where it gave one, the default elsewhere. Two spellings of one setting (another
key order, a default written out) resolve alike, so they share a cache entry; settings equal to
the defaults resolve to ``None``, so a request without settings and one that restates the defaults
keep today's cache keys (no entry is invalidated by turning the feature on). ``digest`` names
effective settings in a cache key, framed as the fingerprint is (``hashing.frame``).

Invariants: ``resolve`` never returns a value outside its key's (capped) bounds, never a key the
family did not declare, and raises ``BadInput`` (type ``invalid_setting``) naming the key for
anything else; the caller attributes it to an item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import blake3

from encode_server.core.errors import BadInput, EncodeServerError
from encode_server.core.hashing import frame

__all__ = [
    "AUDIO_IN_VIDEO", "SETTINGS_DOMAIN", "RequestSettings", "Setting", "describe", "digest", "refuse_prompt_keys",
    "resolve",
]

SETTINGS_DOMAIN = "encode-server/mm-processor-kwargs/v1"
# vLLM's key for the Omni thinkers' video with its own sound: a setting of the prompt, never an item's
AUDIO_IN_VIDEO = "use_audio_in_video"
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,)}


@dataclass(frozen=True)
class Setting:
    """One key a family takes per request, named as vLLM names it in ``vllm_field``.

    ``vllm_field``: where vLLM's chat API takes it (``mm_processor_kwargs``, or
    ``media_io_kwargs.video`` for its video loader's); encode-server's own API carries every key of
    an item in the item's ``mm_processor_kwargs``, by name (the names never clash).
    ``kind``: ``int``, ``float`` or ``bool`` (a JSON ``true`` is never an int, nor ``1`` a bool);
    ``minimum``/``maximum``: the bounds of a number, inclusive (``maximum`` None: only ``cap`` and
    ``ceiling`` bound it); ``cap``: the server limit that bounds it too (``max_image_pixels``), by
    name, so the family module needs no settings object; ``ceiling``: the setting whose *default*
    bounds it too (the checkpoint's ``max_pixels``); ``modalities``: the items it applies to."""

    name: str
    kind: str
    meaning: str
    minimum: float | None = None
    maximum: float | None = None
    cap: str | None = None
    ceiling: str | None = None
    modalities: tuple[str, ...] = ("image",)
    above: float | None = None
    server_default: str | None = None
    vllm_field: str = "mm_processor_kwargs"

    def __post_init__(self) -> None:
        if self.kind not in _TYPES:
            raise ValueError(f"a setting's kind is one of {sorted(_TYPES)}, not {self.kind!r}")

    def bounds(
        self, limits: Mapping[str, float], defaults: Mapping[str, Any]
    ) -> tuple[float | None, float | None, str]:
        """(minimum, maximum, what sets the maximum) with the server's cap and the ceiling applied."""
        tops = [(float(self.maximum), "")] if self.maximum is not None else []
        if self.cap is not None:
            tops.append((float(limits[self.cap]), f"--{self.cap.replace('_', '-')}"))
        if self.ceiling is not None:
            tops.append((float(defaults[self.ceiling]), f"the checkpoint's {self.ceiling}"))
        top, why = min(tops) if tops else (None, "")
        return self.minimum, top, why

    def check(self, value: object, limits: Mapping[str, float], defaults: Mapping[str, Any]) -> Any:
        """``value`` if it is of this key's type and within its bounds; ``BadInput`` naming the key."""
        ok = isinstance(value, _TYPES[self.kind]) and (self.kind == "bool" or not isinstance(value, bool))
        if not ok:
            wanted = {"int": "an integer", "float": "a number", "bool": "true or false"}[self.kind]
            raise BadInput(f"mm_processor_kwargs.{self.name} must be {wanted}, got {type(value).__name__}",
                           type="invalid_setting")
        if self.kind == "bool":
            return value
        low, high, why = self.bounds(limits, defaults)
        number = float(value)  # type: ignore[arg-type]
        if (number != number or (low is not None and number < low) or (high is not None and number > high)
                or (self.above is not None and number <= self.above)):
            ranges = [f"at least {low:g}"] if low is not None else []
            ranges += [f"above {self.above:g}"] if self.above is not None else []
            ranges += [f"at most {high:g}" + (f" ({why})" if why else "")] if high is not None else []
            raise BadInput(f"mm_processor_kwargs.{self.name} must be {' and '.join(ranges)}, got {value!r}",
                           type="invalid_setting")
        return float(value) if self.kind == "float" else value  # type: ignore[arg-type]


def refuse_prompt_keys(given: object) -> None:
    """Refuse a key of vLLM's ``mm_processor_kwargs`` that sets the prompt, not an item
    (``use_audio_in_video``), with what to send instead: whether or not settings are on."""
    if isinstance(given, Mapping) and AUDIO_IN_VIDEO in given:
        raise BadInput(f"mm_processor_kwargs.{AUDIO_IN_VIDEO} is the prompt's setting, not an item's: send the video "
                       "as a video item and its sound as an audio item of the same bytes (encode-epd-proxy does both)",
                       type="invalid_setting")


def resolve(
    declared: Sequence[Setting],
    defaults: Mapping[str, Any],
    given: Mapping[str, Any] | None,
    limits: Mapping[str, float],
    modality: str = "image",
) -> dict[str, Any] | None:
    """The effective settings for one item (module docstring), or None when they are the defaults.

    ``given`` is what the request sent (None or empty: nothing). A key the family does not declare,
    or declares for another modality, a wrong type or a value out of bounds is ``BadInput``."""
    if not given:
        return None
    refuse_prompt_keys(given)
    if not isinstance(given, Mapping):
        raise BadInput(f"mm_processor_kwargs must be an object, got {type(given).__name__}", type="invalid_setting")
    by_name = {s.name: s for s in declared}
    effective = {s.name: defaults[s.name] for s in declared if modality in s.modalities}
    for name, value in given.items():
        setting = by_name.get(name)
        if setting is None:
            known = ", ".join(by_name) or "none"
            raise BadInput(f"mm_processor_kwargs.{name} is not a setting of this model's family (its keys: {known})",
                           type="invalid_setting")
        if modality not in setting.modalities:
            article = "an" if modality[:1] in "aeiou" else "a"
            raise BadInput(f"mm_processor_kwargs.{name} does not apply to {article} {modality}",
                           type="invalid_setting")
        effective[name] = setting.check(value, limits, defaults)
    return None if effective == {k: defaults[k] for k in effective} else effective


def digest(effective: Mapping[str, Any]) -> str:
    """The cache key's name for ``effective`` settings: BLAKE3 of their framed form (order-free:
    ``frame`` sorts a mapping's keys), domain-separated from every other digest."""
    return blake3.blake3(frame(SETTINGS_DOMAIN, dict(effective))).hexdigest()


def describe(declared: Sequence[Setting], defaults: Mapping[str, Any], limits: Mapping[str, float]) -> dict[str, Any]:
    """The JSON form ``GET /v1/model`` publishes: per key its type, bounds (capped), default, meaning."""
    out: dict[str, Any] = {}
    for s in declared:
        low, high, _ = s.bounds(limits, defaults)
        out[s.name] = {"type": s.kind, "minimum": low, "maximum": high, "exclusive_minimum": s.above,
                       "default": defaults.get(s.name), "modalities": list(s.modalities),
                       "vllm_field": s.vllm_field, "meaning": s.meaning}
    return out


class RequestSettings:
    """The per-request settings one server takes: its family's ``declared`` keys, their
    ``defaults`` (the checkpoint's, and the server's where a key has one), the server ``limits``
    that cap them, and whether the operator ``trusted`` requests with them
    (``--trust-request-mm-kwargs``, as vLLM refuses them unless told: they change what one item
    costs)."""

    def __init__(self, declared: Sequence[Setting], defaults: Mapping[str, Any], limits: Mapping[str, float], *,
                 trusted: bool) -> None:
        self.declared = tuple(declared)
        self.defaults = dict(defaults)
        self.limits = dict(limits)
        self.trusted = trusted

    def effective(self, given: Mapping[str, Any] | None, modality: str = "image",
                  index: int | None = None) -> dict[str, Any] | None:
        """What an item's ``mm_processor_kwargs`` resolve to (:func:`resolve`; None: the
        defaults); errors name the ``index`` when there is one."""
        if not given:
            return None
        try:
            refuse_prompt_keys(given)
            if not self.trusted:
                raise BadInput(
                    "per-request mm_processor_kwargs are off on this server (start it with "
                    "--trust-request-mm-kwargs to take them)", type="settings_disabled",
                )
            return resolve(self.declared, self.defaults, given, self.limits, modality)
        except EncodeServerError as exc:
            raise (exc.with_index(index) if index is not None else exc) from None

    def describe(self) -> dict[str, Any]:
        """What ``GET /v1/model`` publishes under ``mm_processor_kwargs``: whether they are taken,
        and each key with its (capped) bounds and default, for the proxy to check a chat against."""
        return {"enabled": self.trusted, "keys": describe(self.declared, self.defaults, self.limits)}
