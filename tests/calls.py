"""Small HTTP helpers the integration tests share: base64, BLAKE3, one encode call, a metric."""

from __future__ import annotations

import base64
import re

import httpx
from blake3 import blake3

from tests.server import ServerProcess

__all__ = ["b64", "encode", "h", "metric", "server_errors"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def h(data: bytes) -> str:
    return blake3(data).hexdigest()


def encode(server: ServerProcess, items: list[dict], **extra: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/encode", json={"items": items, **extra}, timeout=60)


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """A sample's value; without ``labels``, the sum over every label set."""
    text = httpx.get(server.url + "/metrics").text
    selector = re.escape(labels) if labels else r"(?:\{[^}]*\})?"
    pattern = re.compile(rf"^{re.escape(name)}{selector}\s+(\S+)$", re.M)
    return sum(float(m.group(1)) for m in pattern.finditer(text))


def server_errors(server: ServerProcess) -> float:
    """5xx answers so far on every /v1 route and gRPC method (gRPC is labelled with HTTP codes)."""
    text = httpx.get(server.url + "/metrics").text
    pattern = re.compile(r'^encode_server_requests_total\{code="5\d\d",route="(?:/v1/|grpc:)[^"]*"\}\s+(\S+)$', re.M)
    return sum(float(m.group(1)) for m in pattern.finditer(text))
