"""One frozen, typed settings object, built once by the CLI and passed down.

Every field is a CLI flag (``--max-batch-size``) and an environment variable
(``ENCODE_SERVER_MAX_BATCH_SIZE``); a flag wins over the environment, which wins over the
default. Nothing reads the environment at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

__all__ = ["ENV_PREFIX", "REDIS_SCHEMES", "Settings", "build_parser", "settings_from", "shown"]

ENV_PREFIX = "ENCODE_SERVER_"
# The most copies of one request held at once: a JSON body while its base64 is parsed and decoded
# (body, parsed text, decoded bytes: about 2.75x), a gRPC message while it is received and parsed
# (4x). The request-memory budget must fit that much for one largest request.
REQUEST_COPIES = 4
# Protobuf framing around a gRPC message's bytes (the receive limit adds it to --max-request-bytes).
MESSAGE_FRAMING = 64 * 1024
# What --redis-url may start with: redis-py's own schemes, and ours for a cluster seed node.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_C_INT_MAX = 2**31 - 1
# What --device may say (its help); whether this torch build can use it is checked before a port opens.
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _opt(default: Any, help: str, *, repr: bool = True, **extra: Any) -> Any:
    return field(default=default, repr=repr, metadata={"help": help, **extra})


@dataclass(frozen=True)
class Settings:
    model: str = _opt(
        "builtin:tiny",
        "model id on the Hugging Face hub, a local directory, builtin:tiny, or a zero-cost tower "
        "(builtin:zero, builtin:zero-qwen7b)",
    )
    revision: str | None = _opt(None, "hub revision (branch, tag or commit) of --model")
    output: str = _opt(
        "hidden", "CLIP/SigLIP only: last hidden state or pooled embedding", choices=("hidden", "pooled")
    )
    device: str = _opt("auto", "auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = _opt(
        "auto",
        "compute and output dtype; auto: for a family with an EPD contract, what vLLM's auto picks for the "
        "checkpoint and device (a bfloat16 checkpoint runs in bfloat16 where supported); otherwise bfloat16 on CUDA, "
        "float32 on the CPU; GET /v1/model says which and why",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    preprocess_device: str = _opt(
        "auto",
        "where images are decoded and preprocessed: cpu (Pillow and the image processor, an image at a time, in "
        "the preprocessing threads), model (a batch at a time on the model's device with torchvision: nvJPEG for "
        "JPEGs on CUDA), auto (model when the model runs on CUDA, torchvision is installed and no vLLM prefill "
        "consumes the family, whose embeddings must be what vLLM's Pillow-decoded tower gives; else cpu)",
        choices=("auto", "cpu", "model"),
    )
    cuda_graphs: bool = _opt(
        True, "replay the tower's forward from CUDA graphs captured at token budgets in the warm-up (CUDA in half "
        "precision, Qwen-style towers but GLM-4.1V; elsewhere the forward runs eagerly): one launch per pass"
    )
    cuda_graph_max_tokens: int = _opt(
        16384, "the largest CUDA graph budget in patch rows (budgets: powers of two from 1024 up to it); a pass above "
        "it is cut into packs that fit, an image above it runs eagerly"
    )
    host: str = _opt("127.0.0.1", "HTTP bind address")
    port: int = _opt(8000, "HTTP port")
    grpc_port: int = _opt(50051, "gRPC port on --host (0 turns gRPC off)")
    cache_mb: float = _opt(
        1024.0, "local embedding cache budget in MiB (0 turns it off); an item larger than it is served, not cached"
    )
    cache_prefix: str = _opt("encode", "cache key prefix: keys are {prefix}:v1:{fingerprint}:{mm_hash}")
    redis_url: str | None = _opt(  # may hold a password: kept out of repr() like the API keys
        None, "shared tier: a redis://HOST[:PORT][/DB], rediss:// (TLS), unix:///PATH/TO/SOCKET, redis+cluster:// or "
        "rediss+cluster:// URL; unset: local tier only", repr=False
    )
    redis_cluster: bool = _opt(False, "treat --redis-url as a Redis Cluster seed node (same as a +cluster scheme)")
    redis_ttl: int = _opt(86400, "seconds a shared-tier entry lives (SET EX); 0: no expiry")
    redis_timeout_ms: float = _opt(
        150.0, "Redis connect and socket timeout in milliseconds; one Redis call is bounded by 3x this"
    )
    redis_max_value_mb: float = _opt(
        64.0, "largest value written to Redis in MiB; larger ones are not written (counted)"
    )
    redis_write_queue: int = _opt(
        512, "writes waiting to go to Redis behind the response (and at most 256 MiB of them); beyond it new "
        "writes are dropped (counted)"
    )
    redis_replay_mb: float = _opt(
        64.0, "MiB of shared-tier writes kept while Redis is unavailable, replayed when it is back (0: none)"
    )
    max_batch_size: int = _opt(32, "most images in one forward pass")
    max_batch_tokens: int = _opt(65536, "most patch tokens in one forward pass (an image above it runs alone)")
    forward_workers: int = _opt(
        0, "forward passes run at once, each on its share of torch's threads (0: on a CPU, one per core torch "
        "uses, at most 4, where a typical image's forward pass, timed at start, takes at least its decode and "
        "preprocessing, else one; a lone pass still gets every core; on a GPU, one)"
    )
    max_wait_ms: float = _opt(
        5.0, "an idle model starts at once; it waits at most this long (ms) only for images still being decoded"
    )
    max_queue: int = _opt(
        1024, "most items (images, videos) pending encode before 503 overloaded (with Retry-After); a video split "
        "into parts is one item"
    )
    max_request_bytes: int = _opt(
        64 * 1024 * 1024, "largest request body, multipart part or gRPC message in bytes (413 payload_too_large)"
    )
    max_inflight_mb: float = _opt(
        2048.0,
        "request bytes held in memory at once, all requests together, in MiB (bodies, decoded base64, "
        "multipart parts, decoded pixels); past it 503 overloaded; 0 turns the bound off",
    )
    max_items: int = _opt(
        64, "most items in one request (413 too_many_items); /v1/lookup and sizes for /v1/tokens take up to "
        "max(1024, this)"
    )
    max_image_pixels: int = _opt(
        40_000_000, "largest image (width x height), read from its header before decoding (413 image_too_large)"
    )
    trust_request_mm_kwargs: bool = _opt(
        False, "take per-request processor settings (mm_processor_kwargs: the keys GET /v1/model's "
        "mm_processor_kwargs lists, e.g. Qwen's max_pixels), as vLLM's flag of this name does; off: a request "
        "carrying them is refused (400 settings_disabled). Settings other than the defaults key their own cache "
        "entries; no pixel key may ask for more than the checkpoint's own settings (the warm-up's worst case); a "
        "Qwen video's fps (vLLM's media_io_kwargs.video.fps) stays within the video limits"
    )
    video_fps: float = _opt(
        2.0, "frames sampled per second of video, as vLLM's video loader samples them (its default: 2; set it to "
        "what vLLM's --media-io-kwargs '{\"video\": {\"fps\": N}}' says); part of the fingerprint"
    )
    max_video_seconds: float = _opt(
        600.0, "longest video accepted, from its header before any frame is decoded (413 video_too_large)"
    )
    max_video_frames: int = _opt(
        768, "most frames one video may sample (vLLM's loader samples at most 768), from its header (413 "
        "video_too_large)"
    )
    max_video_decoded_frames: int = _opt(
        36_000, "most frames decoded for one video (every frame up to its last sampled one; 600 s at 60 fps), "
        "from its header (413 video_too_large): bounds the decoding work one video can ask for, whatever frame "
        "rate its header claims"
    )
    max_audio_seconds: float = _opt(
        600.0, "longest audio file accepted (vLLM's VLLM_MAX_AUDIO_DECODE_DURATION_S default), from its header "
        "before any sample is decoded, and again while decoding (413 audio_too_large)"
    )
    request_timeout: float = _opt(
        60.0, "per-request timeout in seconds (504 timeout past it); the encode itself goes on and is cached"
    )
    preprocess_workers: int = _opt(0, "threads that decode and preprocess images (0: one per CPU core it may use)")
    preprocess_processes: int = _opt(
        0, "worker processes that decode and preprocess images, off the server's GIL (0: none, the threads do it "
        "in the server's process); images with their own mm_processor_kwargs, videos, audio and a device "
        "pipeline (--preprocess-device model) stay on the threads"
    )
    warmup: str = _opt(
        "worst", "before it is ready: 'worst' runs the largest image the limits allow (a full batch of it) and, for "
        "a video family, the longest video, and publishes the peak memory in GET /v1/model (a server that cannot "
        "hold them does not start); 'quick' runs one small image", choices=("worst", "quick"),
    )
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error"))
    log_format: str = _opt("text", "log lines as text, or one JSON object per line", choices=("text", "json"))
    header_timeout: float = _opt(
        10.0, "seconds a client has to send a request's headers, from the connection's opening or the request's "
        "first byte (408 request_timeout past it, closed)"
    )
    body_timeout: float = _opt(
        30.0, "seconds a request body may go without a byte (408 request_timeout past it, closed)"
    )
    max_header_bytes: int = _opt(
        64 * 1024, "largest request head in bytes: an HTTP request line with its headers (431 headers_too_large, "
        "closed), or a gRPC call's metadata (RESOURCE_EXHAUSTED)"
    )
    keep_alive_timeout: float = _opt(5.0, "seconds an idle keep-alive HTTP connection stays open")
    max_connections: int = _opt(1024, "open HTTP connections; one more gets 503 overloaded and is closed")
    drain_seconds: float = _opt(
        30.0, "on SIGTERM, how long in-flight requests may take to finish before exit; a second SIGTERM or SIGINT "
        "stops at once (what is in flight: 503 not_ready)"
    )
    # Secrets: kept out of repr() so that logging the settings can never print a key.
    api_key: str | None = _opt(
        None, "one API key, or tenant:key; /v1/* then needs Authorization: Bearer KEY", repr=False
    )
    api_keys: str | None = _opt(None, "comma-separated API keys, each key or tenant:key", repr=False)
    tenant_isolation: bool = _opt(False, "make the tenant of the API key part of every cache key")
    export_dir: str | None = _opt(
        None, "also write each embedding to DIR/<mm_hash>/encoder_cache.safetensors (vLLM's ECExampleConnector)"
    )
    export_max_mb: float = _opt(
        10240.0, "disk budget of --export-dir in MiB; the least recently written or re-used files go first"
    )
    sglang: bool = _opt(
        False, "also serve SGLang's encoder protocol, so a --language-only SGLang prefill can name this server in "
        "--encoder-urls: POST /encode and POST /scheduler_receive_url, embeddings pushed to the prefill over ZMQ "
        "(zmq_to_scheduler, zmq_to_tokenizer), the gRPC SglangEncoder service on --grpc-port; needs pyzmq "
        "(the sglang extra) and a family SGLang takes from an encoder (docs/sglang.md)"
    )
    sglang_fetch_private: bool = _opt(
        False, "--sglang: fetch mm_items URLs that resolve to private, loopback, link-local or reserved addresses "
        "(refused by default, so a request cannot make the server reach into its own network)"
    )
    sglang_file_dir: str | None = _opt(
        None, "--sglang: read mm_items that are local paths or file:// URLs, from inside this directory only; "
        "unset, every path is refused"
    )
    sglang_register_urls: str | None = _opt(
        None, "--sglang: comma-separated SGLang encoder bootstrap URLs (a prefill's http://HOST:8997) this server "
        "registers with once ready and unregisters from on shutdown, as SGLang's --encoder-register-urls does"
    )
    sglang_url: str | None = _opt(
        None, "--sglang: the URL this server registers as (default http://HOST:PORT, HOST the address that reaches "
        "the bootstrap when --host is 0.0.0.0 or ::)"
    )

    @property
    def redis_max_value_bytes(self) -> int:
        return int(self.redis_max_value_mb * 1024 * 1024)

    @property
    def max_light_items(self) -> int:
        """Most hashes in a lookup, or sizes in a token count: no image bytes, so a wider limit."""
        return max(1024, self.max_items)

    @property
    def redis_replay_bytes(self) -> int:
        return int(self.redis_replay_mb * 1024 * 1024)

    @property
    def export_max_bytes(self) -> int:
        return int(self.export_max_mb * 1024 * 1024)

    @property
    def max_inflight_bytes(self) -> int | None:
        """The request-memory budget in bytes; None when ``--max-inflight-mb 0`` turns it off."""
        return int(self.max_inflight_mb * 1024 * 1024) or None

    @property
    def preprocess_threads(self) -> int:
        """``--preprocess-workers``, or one per usable core: decoding beside the forward pass with
        more threads than cores only takes the cores from torch's own threads (measured on 2
        cores, ViT-B/32-sized: 4 threads 0.935 of the bare pipeline's rate, 2 threads 0.96)."""
        if self.preprocess_workers:
            return self.preprocess_workers
        usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        return max(1, len(usable))

    @property
    def sglang_register_list(self) -> list[str]:
        """``--sglang-register-urls`` as a list, trailing slashes dropped."""
        return [u.strip().rstrip("/") for u in (self.sglang_register_urls or "").split(",") if u.strip()]

    @property
    def cache_bytes(self) -> int:
        return int(self.cache_mb * 1024 * 1024)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _kind(f: dataclasses.Field[Any]) -> str:
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def shown(value: Any) -> str:
    """A value as ``--help``, the flag table of the docs and the error messages show it: ``1024``,
    not ``1024.0``; a switch as its environment variable spells it (``true``, ``false``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


_NUMBERS: dict[str, tuple[Callable[[str], Any], str]] = {"int": (int, "an integer"), "float": (float, "a number")}


def _parse(f: dataclasses.Field[Any]) -> Callable[[str], Any]:
    """What argparse converts a flag's text with, and names in its message ("invalid int value")."""
    return next((parse for kind, (parse, _) in _NUMBERS.items() if _kind(f).startswith(kind)), str)


def _convert(f: dataclasses.Field[Any], raw: str) -> Any:
    kind = _kind(f)
    for number, (parse, what) in _NUMBERS.items():
        if kind.startswith(number):
            try:
                return parse(raw)
            except ValueError:
                raise ValueError(f"expected {what}") from None
    if kind.startswith("bool"):
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"expected one of {_TRUE + _FALSE}")
        return word in _TRUE
    return raw


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="encode-server",
        description="Vision-encoder service: images (or their hashes) in, embeddings out.",
        epilog=f"Every flag is also an environment variable: {ENV_PREFIX}<FLAG_NAME>, e.g. "
        f"{ENV_PREFIX}MAX_BATCH_SIZE=16.",
    )
    for f in fields(Settings):
        if _kind(f) == "bool":  # a switch and its negation: --tenant-isolation / --no-tenant-isolation
            parser.add_argument(
                _flag(f.name), dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                help=f"{f.metadata['help']} (default: {shown(f.default)})",
            )
            continue
        parser.add_argument(
            _flag(f.name),
            dest=f.name,
            default=None,
            type=_parse(f),
            choices=f.metadata.get("choices"),
            help=f"{f.metadata['help']} (default: {shown(f.default)})",
        )
    return parser


def settings_from(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Defaults, overridden by ``ENCODE_SERVER_*`` variables, overridden by flags."""
    environ = environ or {}
    args = build_parser().parse_args(list(argv or []))
    values: dict[str, Any] = {}
    for f in fields(Settings):
        cli = getattr(args, f.name)
        env = environ.get(ENV_PREFIX + f.name.upper())
        if cli is not None:
            values[f.name] = cli
        elif env is not None:
            choices = f.metadata.get("choices")
            try:
                value = _convert(f, env)
            except ValueError as exc:
                raise SystemExit(f"{ENV_PREFIX}{f.name.upper()}={env!r}: {exc}") from None
            if choices and value not in choices:
                raise SystemExit(f"{ENV_PREFIX}{f.name.upper()}={env!r}: expected one of {choices}")
            values[f.name] = value
    settings = Settings(**values)
    _validate(settings)
    return settings


def _validate(s: Settings) -> None:
    for f in fields(Settings):  # nan passes every comparison below; inf is no bound any check can use
        value = getattr(s, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"{_flag(f.name)} must be a finite number, got {value}")
    if not s.model.strip():
        raise SystemExit("--model must name a model: a hub id, a local directory, or builtin:tiny")
    if not s.host.strip():
        raise SystemExit("--host must be an address (0.0.0.0 or :: for every interface)")
    positive = (
        "max_batch_size", "max_batch_tokens", "max_queue", "max_request_bytes", "max_items", "max_connections",
        "header_timeout", "body_timeout", "keep_alive_timeout", "video_fps", "max_video_seconds", "max_video_frames",
        "max_video_decoded_frames", "max_audio_seconds", "redis_timeout_ms", "redis_max_value_mb", "redis_write_queue",
        "request_timeout", "max_header_bytes", "max_image_pixels",
    )
    for name in positive:
        if getattr(s, name) <= 0:
            raise SystemExit(f"{_flag(name)} must be positive, got {shown(getattr(s, name))}")
    if not 0 <= s.grpc_port <= 65535:
        raise SystemExit(f"--grpc-port must be 0 (off) or a port number, got {s.grpc_port}")
    if s.redis_ttl < 0:
        raise SystemExit(f"--redis-ttl must be >= 0 (0: no expiry), got {s.redis_ttl}")
    if s.cache_mb < 0:
        raise SystemExit(f"--cache-mb must be >= 0 (0 turns the local cache off), got {shown(s.cache_mb)}")
    if s.max_wait_ms < 0:
        raise SystemExit(f"--max-wait-ms must be >= 0, got {shown(s.max_wait_ms)}")
    if s.forward_workers < 0:
        raise SystemExit(f"--forward-workers must be >= 0 (0: chosen for the device), got {s.forward_workers}")
    if s.preprocess_processes < 0:
        raise SystemExit(f"--preprocess-processes must be >= 0 (0: none), got {s.preprocess_processes}")
    if s.preprocess_workers < 0:
        raise SystemExit(f"--preprocess-workers must be >= 0 (0: one per core), got {s.preprocess_workers}")
    if s.redis_replay_mb < 0:
        raise SystemExit(f"--redis-replay-mb must be >= 0, got {shown(s.redis_replay_mb)}")
    if s.export_dir is not None and s.tenant_isolation:
        raise SystemExit("--export-dir cannot be used with --tenant-isolation: vLLM's file layout has no tenant")
    if not s.sglang:
        for name in ("sglang_fetch_private", "sglang_file_dir", "sglang_register_urls", "sglang_url"):
            if getattr(s, name):
                raise SystemExit(f"{_flag(name)} needs --sglang")
    for url in [*s.sglang_register_list, *([s.sglang_url] if s.sglang_url else [])]:
        if not url.startswith(("http://", "https://")) or not urlsplit(url).hostname:
            raise SystemExit(f"--sglang-register-urls and --sglang-url take http(s)://HOST:PORT URLs, got {url!r}")
    if s.export_max_mb <= 0:
        raise SystemExit(f"--export-max-mb must be positive, got {shown(s.export_max_mb)}")
    if s.max_inflight_mb < 0:
        raise SystemExit(f"--max-inflight-mb must be >= 0 (0: no bound), got {shown(s.max_inflight_mb)}")
    budget = s.max_inflight_bytes
    floor = REQUEST_COPIES * (s.max_request_bytes + MESSAGE_FRAMING)
    if budget is not None and budget < floor:
        raise SystemExit(
            f"--max-inflight-mb ({s.max_inflight_mb:g} MiB) must hold one largest request with its copies "
            f"({REQUEST_COPIES} x (--max-request-bytes + 64 KiB) = {floor / 2**20:.2f} MiB), or such a request "
            "could never be served"
        )
    if s.cuda_graph_max_tokens < 0:
        raise SystemExit(f"--cuda-graph-max-tokens must be >= 0, got {s.cuda_graph_max_tokens}")
    if s.drain_seconds < 0:
        raise SystemExit(f"--drain-seconds must be >= 0, got {shown(s.drain_seconds)}")
    if not 0 <= s.port <= 65535:
        raise SystemExit(f"--port must be a port number, got {s.port}")
    if not _DEVICE.fullmatch(s.device):
        raise SystemExit(f"--device must be auto, cpu, cuda or cuda:N, got {s.device!r}")
    if s.redis_url:  # empty, as a compose file's ${VAR:-} gives it: unset
        _check_redis_url(s.redis_url, s.redis_cluster)
    if s.export_dir is not None and not s.export_dir.strip():
        raise SystemExit("--export-dir must name a directory (unset it to export nothing)")
    # grpc-core takes its limits as C ints: past them the gRPC door could not start.
    if s.max_header_bytes > _C_INT_MAX:
        raise SystemExit(f"--max-header-bytes must be at most {_C_INT_MAX} (gRPC's limit), got {s.max_header_bytes}")
    if s.max_request_bytes + MESSAGE_FRAMING > _C_INT_MAX:
        raise SystemExit(f"--max-request-bytes must be at most {_C_INT_MAX - MESSAGE_FRAMING} (gRPC's message limit "
                         f"less its framing), got {s.max_request_bytes}")
    if s.redis_timeout_ms > 3_600_000:
        raise SystemExit(f"--redis-timeout-ms must be at most 3600000 (an hour), got {s.redis_timeout_ms:g}")
    if s.redis_ttl > _C_INT_MAX:
        raise SystemExit(f"--redis-ttl must be at most {_C_INT_MAX} s (68 years; 0: no expiry), got {s.redis_ttl}")


def _check_redis_url(url: str, cluster: bool) -> None:
    """What can be told of ``--redis-url`` without Redis: its scheme and port (redis-py checks the
    rest, before a port opens). The message never repeats the URL: it may hold a password."""
    schemes = ", ".join(REDIS_SCHEMES)
    scheme = url[: url.find("://") + 3].lower() if "://" in url else ""
    if scheme not in REDIS_SCHEMES:
        raise SystemExit(f"--redis-url must start with one of {schemes} (e.g. redis://localhost:6379)")
    if scheme == "unix://":
        if cluster:
            raise SystemExit("--redis-cluster needs a redis:// or rediss:// URL, not unix://")
        if not urlsplit(url).path:
            raise SystemExit("--redis-url: a unix:// URL needs the socket's path (unix:///run/redis.sock)")
        return
    try:
        urlsplit(url).port  # noqa: B018 (it raises for a port that is not a number in range)
    except ValueError as exc:
        raise SystemExit(f"--redis-url: {exc}") from None
