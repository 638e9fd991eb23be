"""The EPD request path: an OpenAI chat-completions request with images, videos and audio rewritten
for a prefill worker that takes their embeddings from encode-server (an EC consumer,
``encode_client.vllm_connector``). docs/epd-proxy.md says what each part becomes and what is refused.

Three pieces, each of its own module and without I/O: the family's contract (``epd_contract``), the
chat's checks (``epd_checks``) and the rewrite of a checked chat from the hand-off's results
(``epd_rewrite``). This module hands the items off, as one flow of the client's calls
(``_rewrite_flow``) that ``Client`` and ``AsyncClient`` drive as they drive their own; every public
name of the pieces is importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from encode_client._base import BaseClient, Flow, gather
from encode_client._client import AsyncClient, Client
from encode_client._errors import ServerError
from encode_client._types import Result
from encode_client.epd_checks import (
    AUDIO_IN_VIDEO,
    AUDIO_PARTS,
    EMBEDS_PARTS,
    IMAGE_PARTS,
    REFUSED_FIELDS,
    VIDEO_PARTS,
    ChatPlan,
    EmbedsPart,
    MediaPart,
    audio_in_video,
    check_chat_request,
    check_contract,
    check_request_fields,
    find_image_parts,
    video_settings,
)
from encode_client.epd_contract import (
    EPD_MODES,
    MEDIA_IO_FIELD,
    PER_MODALITY,
    SETTINGS_FIELD,
    EpdContract,
    EpdContractError,
    EPDError,
)
from encode_client.epd_rewrite import apply_results, cache_salt

__all__ = [
    "AUDIO_IN_VIDEO",
    "AUDIO_PARTS",
    "EMBEDS_PARTS",
    "EPD_MODES",
    "IMAGE_PARTS",
    "MEDIA_IO_FIELD",
    "PER_MODALITY",
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


def _rewrite_flow(
    body: Mapping[str, Any], plan: ChatPlan, client: BaseClient, contract: EpdContract | None
) -> Flow[tuple[dict[str, Any], list[Result]]]:
    """The contract (``contract``, else read from ``GET /v1/model``) and its check, the hand-offs
    (the images in one, each video and each audio file in one of its own, all at once) and
    ``apply_results``. A chat without media asks encode-server nothing. Of several failed
    hand-offs the first in ``plan.media`` order is raised, an item encode-server refused as an
    ``EPDError`` naming its part (``_refused_item``)."""
    if not plan.media:
        return apply_results(body, plan, [], None), []
    if contract is None:
        contract = EpdContract.from_model((yield from client._model_flow()))
    check_contract(plan, contract)
    settings = plan.settings
    sampled = {**(settings or {}), **(plan.video_settings or {})} or None  # the server's keys never clash
    handoffs = [client._encode_flow([p.data for p in plan.images], "handoff", "image", settings)] if plan.images else []
    handoffs += [client._encode_flow([v.data], "handoff", "video", sampled) for v in plan.videos]
    handoffs += [client._encode_flow([a.data], "handoff", "audio", settings) for a in [*plan.audios, *plan.sounds]]
    outcomes = yield from gather(handoffs)
    named: list[MediaPart | None] = [None] if plan.images else []  # the images' call: its error's index names one
    results: list[Result] = []
    for part, outcome in zip([*named, *plan.videos, *plan.audios, *plan.sounds], outcomes, strict=True):
        if part is None and isinstance(outcome, ServerError) and outcome.index is not None \
                and 0 <= outcome.index < len(plan.images):
            part = plan.images[outcome.index]  # the images' call: the server's index is the client's
        if part is not None and isinstance(outcome, ServerError):
            raise _refused_item(part, outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        results += outcome
    return apply_results(body, plan, results, contract), results


def _refused_item(part: MediaPart, exc: ServerError) -> EPDError | ServerError:
    """An image, video or audio file encode-server refused (a 4xx naming the item): the request's fault,
    named by its part. Anything else (overload, no shared tier, a key refused) stays the server's error."""
    if 400 <= exc.status < 500 and exc.index is not None and exc.status not in (401, 403, 409, 429):
        return EPDError(f"encode-server refused this {part.modality}: {exc.status} {exc.type}: {exc.message}",
                        part.where)
    return exc


def rewrite_chat_plan(
    body: Mapping[str, Any], plan: ChatPlan, client: Client, *, contract: EpdContract | None = None
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request`` for a request already checked into ``plan``."""
    return client._run(_rewrite_flow(body, plan, client, contract))


async def rewrite_chat_plan_async(
    body: Mapping[str, Any], plan: ChatPlan, client: AsyncClient, *, contract: EpdContract | None = None
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request_async`` for a request already checked into ``plan``."""
    return await client._run(_rewrite_flow(body, plan, client, contract))


def rewrite_chat_request(
    body: Mapping[str, Any],
    client: Client,
    *,
    trust_client_embeds: bool = False,
    contract: EpdContract | None = None,
    trust_request_mm_kwargs: bool = False,
) -> tuple[dict[str, Any], list[Result]]:
    """``body`` with each image, video and audio part rewritten in the served family's EPD mode, named
    by its identifier; ``trust_client_embeds`` lets embeddings parts through, re-keyed by content;
    ``trust_request_mm_kwargs`` takes the body's ``mm_processor_kwargs`` (checked against the
    family's keys, every item handed off under them). ``contract``: the family's, or None to read it
    from ``client.model()`` (only for a request with media). The results are the hand-off's, one per
    ``ChatPlan.media`` (images, videos, audio, then the videos' sounds, each in request order).

    Each item is in encode-server's shared tier when this returns. Raises ``EPDError`` for a part it
    cannot read or refuses (an item encode-server refuses included), ``EpdContractError`` when the
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
    contract: EpdContract | None = None,
    trust_request_mm_kwargs: bool = False,
) -> tuple[dict[str, Any], list[Result]]:
    """``rewrite_chat_request`` with an ``AsyncClient``: its hand-offs at once."""
    plan = check_chat_request(body, trust_client_embeds=trust_client_embeds,
                              trust_request_mm_kwargs=trust_request_mm_kwargs)
    return await rewrite_chat_plan_async(body, plan, client, contract=contract)
