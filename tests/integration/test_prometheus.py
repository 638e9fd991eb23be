"""/metrics after real traffic: every DESIGN section 6 metric, valid for promtool, and read back
through a real Prometheus that scrapes the server."""

from __future__ import annotations

import base64
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from blake3 import blake3

from tests.images import image_bytes
from tests.server import ServerProcess, free_port, start_server
from tests.tools import require_tool

DESIGN_METRICS = {
    "requests_total": "counter", "items_total": "counter", "cache_lookups_total": "counter",
    "cache_bytes": "gauge", "cache_entries": "gauge", "cache_evictions_total": "counter",
    "batch_size": "histogram", "batch_tokens": "histogram", "queue_wait_seconds": "histogram",
    "preprocess_seconds": "histogram", "forward_seconds": "histogram", "request_seconds": "histogram",
    "queue_depth": "gauge", "inflight_requests": "gauge", "redis_errors_total": "counter", "redis_up": "gauge",
    "upload_bytes_total": "counter", "response_bytes_total": "counter", "rejected_total": "counter",
    "model_info": "gauge",
}
# The traffic below: 3 uploads (encoded), 2 of them again by hash (hits), 1 unknown hash (miss).
EXPECTED_ITEMS = {("encoded", "encoder"): 3.0, ("hit", "local"): 2.0, ("miss", "none"): 1.0}


@pytest.fixture(scope="module")
def served(server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(log_dir=server_logs)
    images = [image_bytes("PNG", 40 + 8 * i, 32, seed=500 + i) for i in range(3)]
    for data in images:
        r = httpx.post(server.url + "/v1/encode", json={"items": [{"data": base64.b64encode(data).decode()}]})
        assert r.status_code == 200, r.text
    hashes = [{"hash": blake3(d).hexdigest()} for d in images[:2]] + [{"hash": "ef" * 32}]
    assert httpx.post(server.url + "/v1/encode", json={"items": hashes}).status_code == 200
    yield server
    assert server.stop() == 0, server.log()


def scrape(server: ServerProcess) -> str:
    return httpx.get(server.url + "/metrics").text


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = re.compile(rf"^encode_server_{re.escape(name)}{re.escape(labels)}\s+(\S+)$", re.M)
    return sum(float(m.group(1)) for m in pattern.finditer(text))


def test_every_design_metric_is_exposed_with_its_type_and_updated(served: ServerProcess) -> None:
    text = scrape(served)
    for name, kind in DESIGN_METRICS.items():
        assert re.search(rf"^# TYPE encode_server_{name} {kind}$", text, re.M), name
    for name in ("preprocess_seconds_count", "forward_seconds_count", "queue_wait_seconds_count",
                 "batch_size_count", "batch_tokens_sum", "upload_bytes_total", "response_bytes_total"):
        assert sample(text, name) > 0, name
    assert sample(text, "preprocess_seconds_count") == 3  # the three uploads; warm-up is not a request
    assert sample(text, "cache_lookups_total", '{result="hit",tier="local"}') == 2
    assert re.search(r'^encode_server_model_info\{.*model="builtin:tiny".*\} 1\.0$', text, re.M)
    for (status, source), count in EXPECTED_ITEMS.items():
        assert sample(text, "items_total", f'{{source="{source}",status="{status}"}}') == count


def test_the_serving_paths_stages_are_timed_per_request_and_per_image(served: ServerProcess) -> None:
    """Four encode requests (three uploads, one of hashes): each read and answered once; each of the
    three images handed to a preprocess thread and back once; no stage longer than its requests."""
    text = scrape(served)
    count = lambda stage: sample(text, "stage_seconds_count", f'{{stage="{stage}"}}')  # noqa: E731
    total = lambda stage: sample(text, "stage_seconds_sum", f'{{stage="{stage}"}}')  # noqa: E731
    assert count("read") == count("respond") == 4
    assert count("to_preprocess") == count("from_preprocess") == 3
    requests = sample(text, "request_seconds_sum", '{route="/v1/encode"}')
    assert all(0 < total(stage) < requests for stage in ("read", "to_preprocess", "from_preprocess", "respond"))


def test_the_startup_heap_is_frozen_and_the_collectors_pauses_are_timed(served: ServerProcess) -> None:
    """The model and its libraries (torch, transformers: far more than 100,000 tracked objects) are
    out of the collector's walks once warm; the collections that loading, the warm-up and the
    traffic above ran were timed, each generation apart."""
    text = scrape(served)
    assert sample(text, "gc_frozen_objects") > 100_000
    for generation in "012":
        labels = f'{{generation="{generation}"}}'
        assert sample(text, "gc_pause_seconds_count", labels) > 0, generation
        assert 0 < sample(text, "gc_pause_seconds_sum", labels) < 60, generation
    assert "objects alive after the warm-up frozen out" in served.log()


def test_promtool_accepts_the_scrape(served: ServerProcess, tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    done = subprocess.run([promtool, "check", "metrics"], input=scrape(served), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_real_prometheus_scrapes_the_server(served: ServerProcess, tmp_path: Path) -> None:
    prometheus = require_tool("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    target = served.url.removeprefix("http://")
    config.write_text(
        "global: {scrape_interval: 200ms, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: encode-server, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        query = 'sum by (status, source) (encode_server_items_total{job="encode-server"})'
        got: dict[tuple[str, str], float] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and got != EXPECTED_ITEMS:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=5)
                result = r.json()["data"]["result"] if r.status_code == 200 else []
                got = {(s["metric"]["status"], s["metric"]["source"]): float(s["value"][1]) for s in result}
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert got == EXPECTED_ITEMS, (tmp_path / "prometheus.log").read_text()[-3000:]
        up = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": 'up{job="encode-server"}'})
        assert up.json()["data"]["result"][0]["value"][1] == "1"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_counters_with_a_known_label_set_start_at_zero(server_logs: Path, shared_redis_url: str) -> None:
    """A fresh server exposes every series of a closed label set at 0, so a dashboard's
    ``rejected_total{reason="memory"}`` reads 0 instead of "no data" before the first refusal."""
    server = start_server("--redis-url", shared_redis_url, "--cache-prefix", "test-zero-series", log_dir=server_logs)
    try:
        text = scrape(server)
    finally:
        assert server.stop() == 0, server.log()
    for reason in ("overloaded", "memory", "not_ready", "timeout", "unauthorized"):
        assert re.search(rf'^encode_server_rejected_total\{{reason="{reason}"\}} ', text, re.M), reason
    for reason in ("overloaded", "memory", "timeout", "unauthorized"):
        assert sample(text, "rejected_total", f'{{reason="{reason}"}}') == 0.0
    for status, source in (("hit", "local"), ("hit", "redis"), ("encoded", "encoder"), ("miss", "none")):
        labels = f'{{source="{source}",status="{status}"}}'
        assert re.search(rf"^encode_server_items_total{re.escape(labels)} 0\.0$", text, re.M), labels
    for op in ("get", "exists", "set", "ping"):
        assert re.search(rf'^encode_server_redis_errors_total\{{op="{op}"\}} 0\.0$', text, re.M), op
