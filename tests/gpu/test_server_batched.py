"""A real server with ``--preprocess-device model``: the batched path over HTTP, errors included."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.workload import photos
from tests.gpu.conftest import DEVICES
from tests.images import image_bytes, jpeg_without_tables, truncated_jpeg
from tests.server import ServerProcess, start_server


@pytest.fixture(scope="module", params=DEVICES)
def batched_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_dir: Path = tmp_path_factory.mktemp("logs")
    server = start_server("--device", request.param, "--preprocess-device", "model", "--max-wait-ms", "50",
                          log_dir=log_dir)
    yield server
    server.stop()


def _item(data: bytes) -> dict[str, str]:
    return {"data": base64.b64encode(data).decode()}


def test_a_batch_of_formats_encodes_and_its_counts_are_the_token_counts(batched_server: ServerProcess) -> None:
    images = [*photos(61, 2), image_bytes("PNG", 90, 60), image_bytes("WEBP", 50, 40)]
    r = httpx.post(batched_server.url + "/v1/encode", json={"items": [_item(d) for d in images]}, timeout=60)
    assert r.status_code == 200, r.text
    counted = httpx.post(batched_server.url + "/v1/tokens", json={"items": [_item(d) for d in images]}, timeout=60)
    assert counted.status_code == 200, counted.text
    for item, count in zip(r.json()["items"], counted.json()["items"], strict=True):
        assert item["status"] == "encoded" and item["num_tokens"] == count["num_tokens"]
    model = httpx.get(batched_server.url + "/v1/model").json()
    assert model["preprocessing"]["pipeline"].startswith("batched:")


def test_a_jpeg_bad_only_when_decoded_is_a_400_naming_it_and_the_server_goes_on(batched_server: ServerProcess) -> None:
    for bad in (jpeg_without_tables(5), truncated_jpeg(5)):  # both found bad when prepared
        items = [_item(photos(71, 1)[0]), _item(bad)]
        r = httpx.post(batched_server.url + "/v1/encode", json={"items": items}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_image" and r.json()["error"]["index"] == 1
    again = httpx.post(batched_server.url + "/v1/encode", json={"items": [_item(photos(72, 1)[0])]}, timeout=60)
    assert again.status_code == 200 and again.json()["items"][0]["status"] == "encoded"
