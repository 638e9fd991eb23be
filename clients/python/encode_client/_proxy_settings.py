"""The proxy's settings: one frozen, typed object, built once from the command line and checked."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ProxySettings"]


@dataclass(frozen=True)
class ProxySettings:
    """Everything the proxy is told (the command line, ``build_parser``), checked once."""

    vllm_urls: tuple[str, ...]
    encoder_urls: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)
    api_keys: str | None = field(default=None, repr=False)
    vllm_api_key: str | None = field(default=None, repr=False)
    trust_client_embeds: bool = False
    trust_request_mm_kwargs: bool = False  # take a chat's mm_processor_kwargs (checked, handed off with)
    timeout: float = 600.0  # the longest wait for vLLM's next byte
    connect_timeout: float = 5.0
    encoder_timeout: float = 60.0
    max_concurrency: int = 512
    max_connections: int = 1024
    max_body_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024  # a request line and its headers; past it 431
    retries: int = 1
    drain_seconds: float = 30.0
    keep_alive_timeout: float = 5.0
    down_for: float = 5.0

    def __post_init__(self) -> None:
        if self.api_key and self.api_keys:
            raise ValueError("give api_key (one encode-server key) or api_keys (the callers' keys), not both")
        if not self.encoder_urls:
            raise ValueError("at least one encode-server URL (--encoder) is required")
        numbers = (self.timeout, self.connect_timeout, self.encoder_timeout, self.max_concurrency,
                   self.max_connections, self.max_body_bytes, self.max_header_bytes)
        if min(numbers) <= 0 or self.retries < 0 or self.drain_seconds < 0:
            raise ValueError("timeouts, limits and sizes must be > 0; retries and drain seconds >= 0")
