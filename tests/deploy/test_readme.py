"""README.md is the tour a new user reads first: the two commands, a first request, the client, a
real model and the vLLM setup, in about 300 lines, with the depth on the pages it maps. Each topic
is where the map says it is. (Every link resolves: tests/docs/test_links.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _page(name: str) -> str:
    return (ROOT / "docs" / f"{name}.md").read_text()


def test_the_readme_is_a_short_tour() -> None:
    assert len(README.splitlines()) <= 300
    for needle in ("make serve", "make test", "curl -s localhost:8000/v1/encode", '{\\"hash\\": \\"$H\\"}',
                   "from encode_client import", "encode-client", "/v1/tokens", "--model", "EncodeServerECConnector",
                   "encode-epd-proxy", "--redis-url"):
        assert needle in README, needle


def test_each_topic_is_on_its_page() -> None:
    expected = {
        "api": ("grpcurl", "## Error types", "## Limits"),
        "api-items": ("## Video items", "## Audio items", "## Per-request processor settings",
                      "--trust-request-mm-kwargs"),
        "client": ("encode-client warm", "encode-client hash", "AsyncClient", "image_aware_ids"),
        "vllm": ("ec_consumer", "encode-epd-proxy", "--export-dir", "StoreReader", "## Families"),
        "epd-proxy": ("--trust-client-embeds", "pixel_free_alone", "per_modality", "ec_transfer_params", "SSRF"),
        "epd-families": ("use_audio_in_video", "second_per_grid_ts", "vision_chunk", "audio_feature_lengths"),
        "models": ("model_type", "fingerprint", "--dtype", "/v1/tokens"),
        "operations": ("--api-keys", "SIGTERM", "--log-format", "kubectl apply", "docker compose", "--redis-url"),
        "robustness": ("--max-inflight-mb", "make soak", "schemathesis"),
        "benchmarks": ("make bench", "make bench-epd", "bench/results/latest.json", "gpu_check.sh", "## The machine"),
        "benchmark-history": ("## EPD runs", "## Measured, not kept"),
        "development": ("tests/unit", "Encoder", "make test-vllm", "What the vLLM tests prove", "torchvision_cpu_shim"),
    }
    for page, needles in expected.items():
        text = _page(page)
        for needle in needles:
            assert needle in text, f"docs/{page}.md: {needle}"


def _serve_command(*args: str, env: dict[str, str] | None = None) -> str:
    """The encode-server line `make serve` would run (make -n: nothing runs)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ENCODE_SERVER_") and k != "PORT"}
    done = subprocess.run(["make", "-n", "serve", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**environ, **(env or {})}, check=True)
    return next(line for line in done.stdout.splitlines() if "encode-server" in line)


def test_make_serve_says_and_moves_both_ports() -> None:
    assert _serve_command().endswith("--host 0.0.0.0 --port 8000 --grpc-port 50051")
    assert _serve_command("PORT=8001", "GRPC_PORT=50052").endswith("--port 8001 --grpc-port 50052")
    by_env = _serve_command(env={"ENCODE_SERVER_PORT": "8003", "ENCODE_SERVER_GRPC_PORT": "0"})
    assert by_env.endswith("--port 8003 --grpc-port 0")
    for needle in ("gRPC on 0.0.0.0:50051", "make serve PORT=8001 GRPC_PORT=50052", "`GRPC_PORT=0`: no gRPC",
                   "ENCODE_SERVER_GRPC_PORT", "are in `.venv/bin`", ".venv/bin/encode-client",
                   "with what make serve installed: H=$(.venv/bin/encode-client hash cat.png"):
        assert needle in README, needle
