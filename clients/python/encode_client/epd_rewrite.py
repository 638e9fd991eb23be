"""The rewrite: a checked chat (``epd_checks.ChatPlan``) and the hand-off's results made into the body
vLLM gets, each item in its modality's EPD mode and named by its identifier (docs/epd-proxy.md). No I/O."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from typing import Any

from blake3 import blake3

from encode_client._images import mm_hash
from encode_client._types import Result
from encode_client.epd_checks import AUDIO_IN_VIDEO, ChatPlan, MediaPart
from encode_client.epd_contract import MEDIA_IO_FIELD, SETTINGS_FIELD, EpdContract, EPDError
from encode_client.epd_tensor import tensor_string
from encode_client.keys import EC_PARAMS_KEY, embeds_identifier, epd_identifier, own_identifier

__all__ = ["EC_PARAMS_FIELD", "apply_results", "cache_salt"]

EC_PARAMS_FIELD = "ec_transfer_params"
_SALT_DOMAIN = "encode-server/epd/cache-salt/v1"


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
    not changed.

    A pixel-free item becomes a metadata-only ``{modality}_embeds`` part carrying exactly the
    contract's fields (its ``tensors`` as tensor strings); a pixels + uuid item stays its file, with
    its identifier. The body's settings leave it (the metadata carries their effect), unless an item
    goes as pixels + uuid: vLLM's processor then takes them and hashes every uuid with them, so the
    identifiers go in ``ec_transfer_params``, in vLLM's item order, for the connector to map."""
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

