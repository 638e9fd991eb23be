"""The tests that need vLLM to see pixels, on one engine with its vision tower (an EC consumer with
``EncodeServerECConnector`` too, as a prefill that keeps its tower runs): encode-server's
embedding against vLLM's own tower, ``/v1/tokens`` against vLLM's placeholder counts, and the
connector's fallback to vLLM's own encoder when a request carries its pixels.

The documented EPD prefill is tower-free (test_connector.py); this engine exists for the oracle.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from encode_client import Client, mm_hash

from tests.server import ServerProcess, start_server
from tests.vllm.conftest import (
    EPD_PREFIX,
    REDIS_URL,
    connector_config,
    engine,
    epd_baseline,
    greedy,
    model_runner,
    pixels,
    png,
    scheduler_connector,
    tower_parameters,
)
from tests.vllm.tiny_qwen import MAX_PIXELS, MIN_PIXELS

# width x height. The first three are multiples of 28 within [min_pixels, max_pixels]: the
# processor does not resize them. The others are resized (down to max_pixels, or to a multiple of 28).
SIZES = [(56, 56), (112, 84), (224, 168), (150, 100), (300, 260), (400, 60)]
UNRESIZED = 3
IMAGES = [png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def server(epd_server: ServerProcess) -> ServerProcess:
    """The session's encode-server (conftest's ``epd_server``, the proxy and security modules' too):
    these images (seeds 0-5, 77, 100 on) are this module's own."""
    return epd_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, response="json", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_dir: Path, server: ServerProcess) -> Iterator[Any]:
    with engine(model_dir, connector_config(REDIS_URL, server.url, EPD_PREFIX), tower=True) as llm:
        print(f"\nvLLM engine (EC consumer with its tower) started in {llm.startup_seconds:.1f} s")
        yield llm


@pytest.fixture(scope="module")
def baseline(llm: Any, client: Client) -> dict[str, Any]:
    return epd_baseline(llm, client, IMAGES)


def test_this_engine_holds_its_tower(llm: Any, baseline: dict[str, Any]) -> None:
    assert tower_parameters(llm) > 0
    assert baseline["connector"] == baseline["direct"]


def test_with_pixels_vllm_encodes_what_the_store_lacks(llm: Any, baseline: dict[str, Any]) -> None:
    """An image the store has never held, sent with its pixels: the connector says "not mine",
    vLLM runs its own tower, and the tokens equal plain vLLM's (no uuid)."""
    image = png(84, 112, seed=77)
    connector = scheduler_connector(llm)
    before = dict(connector.counts)
    llm.llm_engine.reset_encoder_cache()
    via_connector = greedy(llm, [pixels(image, uuid=mm_hash(image))])
    after = connector.counts
    assert after["absent"] > before.get("absent", 0) and after["local_fallback"] > before.get("local_fallback", 0)
    llm.llm_engine.reset_encoder_cache()
    assert via_connector == greedy(llm, [pixels(image)])


def test_embedding_and_tokens_match_vllms_own_vision_tower(llm: Any, baseline: dict[str, Any]) -> None:
    """encode-server's embedding == vLLM's own vision tower output for the same image, and plain
    vLLM on the pixels gives the tokens the EPD request gives.

    Exact up to float32 noise (max |diff| <= 1e-5 x the largest magnitude), for images the
    processor keeps as they are and for those it resizes: vLLM runs transformers' torchvision-backend
    processor, and encode-server (no torchvision) makes its pixels with the same torch operations
    (``encoders/qwen.py``); with PIL's bicubic resize, as it did before, resized images were 2e-2 off.
    """
    own_tokens = greedy(llm, [pixels(data, uuid=f"pixels-{i}") for i, data in enumerate(IMAGES)])
    runner = model_runner(llm)
    report: list[str] = []
    failures: list[str] = []
    for i, emb in enumerate(baseline["embeddings"]):
        own = runner.encoder_cache[f"pixels-{i}"].float().cpu().numpy()
        assert own.shape == emb.shape, (i, own.shape, emb.shape)
        diff = float(np.abs(own - emb).max())
        scale = float(np.abs(emb).max())
        same = own_tokens[i] == baseline["connector"][i]
        kind = "as is" if i < UNRESIZED else "resized"
        report.append(
            f"image {i} {SIZES[i][0]}x{SIZES[i][1]} ({kind}): {emb.shape[0]} tokens, max |diff| {diff:.1e} "
            f"(of max |x| {scale:.1f}), greedy tokens {'equal' if same else 'DIFFER'}"
        )
        failures += [report[-1]] if diff > 1e-5 * max(1.0, scale) or not same else []
    print("\n" + "\n".join(report))
    assert not failures, failures


# Sizes across aspect ratios and scales, inside and outside [min_pixels, max_pixels].
PARITY_SIZES = [
    (28, 28), (56, 56), (64, 48), (100, 100), (111, 97), (150, 100), (224, 224), (225, 223), (300, 300),
    (640, 480), (480, 640), (1024, 64), (64, 1024), (333, 57), (57, 333), (800, 30), (30, 800), (999, 998),
    (13, 200), (200, 13), (1920, 1080), (77, 1500),
]


def _vllm_placeholders(llm: Any, sizes: list[tuple[int, int]], **kwargs: Any) -> list[int]:
    """vLLM's own placeholder count per image: the image tokens in the engine's prompt."""
    from vllm import SamplingParams

    image_token = llm.llm_engine.model_config.hf_config.image_token_id
    requests = []
    for i, (w, h) in enumerate(sizes):
        request = pixels(png(w, h, seed=100 + i))
        if kwargs:
            request["mm_processor_kwargs"] = kwargs
        requests.append(request)
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return [o.prompt_token_ids.count(image_token) for o in outputs]


def _server_tokens(url: str, sizes: list[tuple[int, int]]) -> list[tuple[int, list[int]]]:
    r = httpx.post(url + "/v1/tokens", json={"sizes": [list(s) for s in sizes]}, timeout=30)
    assert r.status_code == 200, r.text
    return [(i["num_tokens"], i["meta"]["image_grid_thw"]) for i in r.json()["items"]]


def _vllm_grid(llm: Any, width: int, height: int, **kwargs: Any) -> list[int]:
    """vLLM's Qwen2-VL resize rule (its own smart_resize call) for one size."""
    from vllm.model_executor.models.qwen2_vl import smart_resize

    vision = llm.llm_engine.model_config.hf_config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    h, w = smart_resize(
        height, width, factor=factor, min_pixels=kwargs.get("min_pixels", MIN_PIXELS),
        max_pixels=kwargs.get("max_pixels", MAX_PIXELS),
    )
    return [1, h // vision.patch_size, w // vision.patch_size]


WIDER = {"min_pixels": 112 * 112, "max_pixels": 448 * 448}


@pytest.mark.parametrize("settings", [{}, WIDER], ids=["checkpoint", "wider"])
def test_token_parity_with_vllm_placeholders(
    llm: Any, model_dir: Path, server: ServerProcess, logs: Path, tmp_path: Path, settings: dict[str, int]
) -> None:
    """encode-server's /v1/tokens (count and image_grid_thw) == vLLM's placeholder count for the
    same checkpoint and processor settings, over many sizes and aspect ratios. "wider": a second
    server on a copy of the checkpoint whose preprocessor_config.json has other min/max pixels, and
    vLLM with the same values as mm_processor_kwargs."""
    url, other = server.url, None
    if settings:
        copy = tmp_path / "model"
        shutil.copytree(model_dir, copy)
        config = json.loads((copy / "preprocessor_config.json").read_text())
        config["size"] = {"shortest_edge": settings["min_pixels"], "longest_edge": settings["max_pixels"]}
        config.update(settings)
        (copy / "preprocessor_config.json").write_text(json.dumps(config))
        other = start_server("--model", str(copy), "--grpc-port", "0", "--dtype", "float32", log_dir=logs)
        url = other.url
    try:
        ours = _server_tokens(url, PARITY_SIZES)
        theirs = _vllm_placeholders(llm, PARITY_SIZES, **settings)
    finally:
        if other is not None:
            other.stop()
    mismatches = [
        (size, mine, count, _vllm_grid(llm, *size, **settings))
        for size, mine, count in zip(PARITY_SIZES, ours, theirs, strict=True)
        if mine[0] != count or mine[1] != _vllm_grid(llm, *size, **settings)
    ]
    assert not mismatches, f"(size, encode-server (N, grid), vLLM N, vLLM grid): {mismatches}"


