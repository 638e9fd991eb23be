"""README.md is the tour a new user reads first: the two commands, a first request, the client, a
real model and the vLLM setup, in about 300 lines, with the depth on the pages it maps. Each topic
is where the map says it is. (Every link resolves: tests/docs/test_links.py.)"""

from __future__ import annotations

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
        "client": ("encode-client warm", "encode-client hash", "AsyncClient", "image_aware_ids"),
        "vllm": ("ec_consumer", "encode-epd-proxy", "--export-dir", "StoreReader", "What the tests prove"),
        "models": ("model_type", "fingerprint", "--dtype", "/v1/tokens"),
        "operations": ("--api-keys", "SIGTERM", "--log-format", "kubectl apply", "docker compose", "--redis-url"),
        "robustness": ("--max-inflight-mb", "make soak", "schemathesis"),
        "benchmarks": ("make bench", "bench/results/latest.json", "gpu_check.sh"),
        "development": ("tests/unit", "VisionEncoder", "make test-vllm"),
    }
    for page, needles in expected.items():
        text = _page(page)
        for needle in needles:
            assert needle in text, f"docs/{page}.md: {needle}"
