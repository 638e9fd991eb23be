"""encode-server's client: hash locally, send hash-only first, upload only the misses (adaptive:
when recent images were rarely cached, it sends the bytes at once; ``client.stats`` says which).

Needs neither torch nor the server package (torch optional: ``encode-client[torch]``; gRPC
optional: ``encode-client[grpc]``).

    from encode_client import Client
    with Client(["http://replica-a:8000", "http://replica-b:8000"], api_key="...") as client:
        results = client.encode(["cat.jpg", "dog.png"])
        tensor = results[0].torch()  # bf16 stays bf16
"""

from encode_client._base import rank_replicas
from encode_client._client import AsyncClient, Client
from encode_client._errors import EncodeClientError, MissingExtra, PrefixKeyError, ReplicaUnavailable, ServerError
from encode_client._images import Video, mm_hash
from encode_client._retry import Backoff, Limits, RetryPolicy
from encode_client._types import LookupItem, Result, TokenCount, UploadStats, WarmItem, to_numpy, to_torch
from encode_client.prefix_key import image_aware_ids, pad_ids

__version__ = "0.2.0"

__all__ = [
    "AsyncClient",
    "Backoff",
    "Client",
    "EncodeClientError",
    "Limits",
    "LookupItem",
    "MissingExtra",
    "PrefixKeyError",
    "ReplicaUnavailable",
    "Result",
    "RetryPolicy",
    "ServerError",
    "TokenCount",
    "UploadStats",
    "Video",
    "WarmItem",
    "__version__",
    "image_aware_ids",
    "mm_hash",
    "pad_ids",
    "rank_replicas",
    "to_numpy",
    "to_torch",
]
