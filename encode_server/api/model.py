"""What ``GET /v1/model`` (and gRPC ``Model``) publishes about the running server: the model and its
fingerprint, the family and its EPD contract (which the connector and the proxy read instead of
keeping their own copy), the batching, the limits and the cache.

Built from what the service exposes, here where the front doors live, so that the service holds
no wire format of its own; both doors answer with this one dictionary.
"""

from __future__ import annotations

from typing import Any

from encode_server.service import EncodeService

__all__ = ["describe_model"]


def describe_model(service: EncodeService) -> dict[str, Any]:
    """The JSON document of ``GET /v1/model`` (docs/api.md)."""
    served, s = service.describe(), service.settings
    info = served.info
    return {
        "model": info.model_id,
        "id": info.model_id,  # deprecated alias of "model" (the name every other answer uses)
        "revision": info.revision,
        "fingerprint": served.fingerprint,
        "kind": info.kind,
        "family": served.family,
        "output": info.output,
        "dtype": info.dtype,
        "dtype_reason": served.dtype_reason,
        "device": info.device,
        "hidden_size": info.hidden_size,
        "widths": dict(info.widths),  # a modality's row width where it is not hidden_size
        "num_parameters": info.num_parameters,
        "weights_digest": info.weights_digest,
        "meaningless": info.meaningless,
        "preprocessing": info.preprocessing,
        "mm_processor_kwargs": service.item_settings.describe(),
        "batching": {
            "max_batch_size": s.max_batch_size,
            "max_batch_tokens": s.max_batch_tokens,
            "max_wait_ms": s.max_wait_ms,
            "max_queue": s.max_queue,
            "forward_passes": service.passes.passes,
            "forward_passes_reason": service.passes.reason,
        },
        "limits": {
            "max_request_bytes": s.max_request_bytes,
            "max_items": s.max_items,
            "max_image_pixels": s.max_image_pixels,
            "request_timeout": s.request_timeout,
        },
        "warmup": service.warmup.describe() if service.warmup is not None else None,
        "cache": {
            "local_bytes": service.local.lru.capacity_bytes,
            "prefix": s.cache_prefix,
            "shared": service.shared.name if service.shared is not None else None,
        },
    }
