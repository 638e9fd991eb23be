"""The image families vLLM takes as pixels + uuid (InternVL, Gemma 3, ...) through ``EncodeServerECConnector``.

For each case of ``families.py``, one vLLM engine (an EC consumer), one encode-server on the same
tiny checkpoint directory, the shared Redis (the family's ``family_engine`` and ``family_server``,
shared with the modules that prove the family again): the request to the prefill carries the image (vLLM's processor
sizes the placeholder from it) and ``uuid`` = the image's mm_hash; the connector supplies the
embedding from encode-server's store, so vLLM's tower does not run for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from encode_client import Client
from encode_client.keys import store_key
from redis import Redis

from tests.server import ServerProcess, start_server
from tests.tiny import copy_with_processor_settings
from tests.vllm.conftest import (
    REDIS_URL,
    SharedEngine,
    greedy,
    on_family_stacks,
    pil,
    png,
    scheduler_connector,
    stored_value,
)
from tests.vllm.epd_stack import FamilyServer
from tests.vllm.families import CASES, FamilyCase

# Each case on its family's shared encode-server and engine (conftest's ``family_server`` and
# ``family_engine``, which the proxy modules and the Omni modules use too): its tests run with the
# family's other tests. Their images (seeds 0-4; 100 on for the placeholder counts) are their own.
pytestmark = on_family_stacks(*(case.name for case in CASES))
CASE = {case.name: case for case in CASES}


@pytest.fixture(scope="module")
def case(family: str) -> FamilyCase:
    return CASE[family]


@pytest.fixture(scope="module")
def checkpoint(family_server: FamilyServer) -> Path:
    return family_server.model


@pytest.fixture(scope="module")
def server(family_server: FamilyServer) -> ServerProcess:
    return family_server.server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, response="json", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(family_engine: SharedEngine) -> Any:
    """An EC consumer that keeps its tower: pixels + uuid, the prefill sees the image (never run for it)."""
    return family_engine.llm


def _images(case: FamilyCase) -> list[bytes]:
    return [png(w, h, seed=i) for i, (w, h) in enumerate(case.sizes)]


def _request(case: FamilyCase, image: Any, uuid: str | None = None) -> dict[str, Any]:
    """One image (or its embedding) as the family's vLLM item (Kimi-K2.5's: a vision_chunk)."""
    request: dict[str, Any] = {"prompt": case.prompt(1), "multi_modal_data": {case.modality: case.item(image, uuid)}}
    if uuid is not None:
        request["multi_modal_uuids"] = {case.modality: [uuid]}
    return request


def _runner(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def baseline(case: FamilyCase, llm: Any, client: Client) -> dict[str, Any]:
    """Each image handed off to encode-server; greedy tokens of the EPD request (pixels, uuid =
    mm_hash) through the connector, and vLLM's own (the same pixels, a uuid the store never holds,
    so vLLM runs its tower and keeps the output in its encoder cache)."""
    images = _images(case)
    results = client.hand_off(images)
    embeddings = [r.numpy() for r in client.encode(images)]
    connector = scheduler_connector(llm)
    before = dict(connector.counts)
    via_connector = greedy(llm, [_request(case, pil(d), r.hash) for d, r in zip(images, results, strict=True)])
    after = dict(connector.counts)
    llm.llm_engine.reset_encoder_cache()
    own = greedy(llm, [_request(case, pil(d), f"own-{i}") for i, d in enumerate(images)])
    towers = [_runner(llm).encoder_cache[f"own-{i}"].float().cpu().numpy() for i in range(len(images))]
    return {
        "images": images, "results": results, "embeddings": embeddings, "connector": via_connector,
        "own": own, "towers": towers, "counts": (before, after),
    }


def test_the_server_publishes_the_pixels_and_uuid_mode(case: FamilyCase, client: Client) -> None:
    """What the proxy reads to pick the rewrite: this family keeps the image and adds the uuid (a
    family of several modes, Qwen3-Omni, says so for its images in ``modes``)."""
    family = client.model()["family"]
    epd = family["epd"]
    if epd["mode"] == "per_modality":
        assert (family["name"], epd["modes"]["image"], "image" in epd["fields"]) == (case.name, "pixels_uuid", False)
    else:
        assert (family["name"], epd["mode"], epd["fields"]) == (case.name, "pixels_uuid", {})


def test_tokens_through_the_connector_equal_vllms_own(case: FamilyCase, baseline: dict[str, Any]) -> None:
    """The prefill took every image from the store (hits, loaded by the worker, no local encode)
    and its greedy tokens are vLLM's own on the same pixels."""
    from vllm.distributed.ec_transfer import get_ec_transfer

    before, after = baseline["counts"]
    n = len(case.sizes)
    assert after.get("hit", 0) - before.get("hit", 0) == n, (before, after)
    assert after.get("local_fallback", 0) == before.get("local_fallback", 0), (before, after)
    assert get_ec_transfer().counts["loaded"] >= n
    assert baseline["connector"] == baseline["own"]


def test_embedding_equals_vllms_own_tower(case: FamilyCase, baseline: dict[str, Any]) -> None:
    """encode-server's embedding == what vLLM's embed_multimodal put in its encoder cache, row for
    row, within float32 noise: max |diff| <= 1e-5 x max(1, the largest magnitude)."""
    report = []
    for (w, h), ours, theirs in zip(case.sizes, baseline["embeddings"], baseline["towers"], strict=True):
        assert ours.shape == theirs.shape, ((w, h), ours.shape, theirs.shape)
        diff, scale = float(np.abs(ours - theirs).max()), float(np.abs(ours).max())
        report.append(f"{w}x{h}: {ours.shape[0]} rows, max |diff| {diff:.1e} of max |x| {scale:.1f}")
        assert diff <= 1e-5 * max(1.0, scale), report[-1]
    print(f"\n{case.name}: " + "; ".join(report))


def test_zeros_in_the_store_change_the_answer(
    case: FamilyCase, llm: Any, client: Client, baseline: dict[str, Any], family_server: FamilyServer
) -> None:
    """The negative control: each stored embedding replaced by zeros of its shape; the EPD request's
    tokens change (the prefill used the store's value, not its own tower on the pixels it has);
    where vLLM takes image_embeds, they are those of the zeros given directly."""
    import torch

    fingerprint = str(client.model()["fingerprint"])
    redis = Redis.from_url(REDIS_URL)
    prefix = family_server.prefix
    requests, direct = [], []
    for data, result, emb in zip(baseline["images"], baseline["results"], baseline["embeddings"], strict=True):
        zeros = np.zeros_like(emb)
        value = stored_value(zeros, fingerprint, result.hash, result.meta)
        redis.set(store_key(fingerprint, result.hash, prefix=prefix), value)
        requests.append(_request(case, pil(data), result.hash))
        if case.image_embeds is not None:
            direct.append(_request(case, case.image_embeds(torch.tensor(zeros), result.meta)))
    llm.llm_engine.reset_encoder_cache()
    zero_tokens = greedy(llm, requests)
    for i, (zero, real) in enumerate(zip(zero_tokens, baseline["connector"], strict=True)):
        assert zero != real, f"{case.sizes[i]}: zeros gave the same tokens as its embedding"
    if case.image_embeds is not None:
        assert zero_tokens == _one_by_one(llm, direct)
    client.hand_off(baseline["images"])  # the server writes its (local-tier) embeddings back over the zeros
    llm.llm_engine.reset_encoder_cache()
    assert greedy(llm, requests) == baseline["connector"]


def _one_by_one(llm: Any, requests: list[dict[str, Any]]) -> list[list[int]]:
    """Greedy tokens, one request a step: vLLM batches image_embeds items only when their row counts
    agree (its schema fixes the feature size across a batch)."""
    return [greedy(llm, [request])[0] for request in requests]


def test_image_embeds_oracle_or_refusal(case: FamilyCase, llm: Any, baseline: dict[str, Any]) -> None:
    """Where vLLM takes a whole image_embeds tensor: the same embedding given directly gives the
    tokens the connector gave. Where it does not, it refuses one (the family's mode is then pixels +
    uuid by vLLM's own decision, checked here, not only read from its source)."""
    import torch

    if case.image_embeds is None:
        whole = [_request(case, [torch.tensor(e)]) for e in baseline["embeddings"][:1]]
        error, words = case.refusal
        with pytest.raises(error, match=words):
            greedy(llm, whole)
        return
    direct = [
        _request(case, case.image_embeds(torch.tensor(e), r.meta))
        for e, r in zip(baseline["embeddings"], baseline["results"], strict=True)
    ]
    assert _one_by_one(llm, direct) == baseline["connector"]


def _vllm_placeholders(llm: Any, case: FamilyCase, sizes: list[tuple[int, int]], kwargs: dict[str, Any]) -> list[int]:
    """vLLM's own placeholder count per image: the image tokens in the engine's prompt."""
    from vllm import SamplingParams

    config = llm.llm_engine.model_config.hf_config
    config = getattr(config, "thinker_config", config)  # an Omni model's tokens are its thinker's
    image_token = getattr(config, "image_token_id", None) or config.image_token_index
    requests = []
    for i, (w, h) in enumerate(sizes):
        request = _request(case, pil(png(w, h, seed=100 + i)))
        if kwargs:
            request["mm_processor_kwargs"] = kwargs
        requests.append(request)
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return [o.prompt_token_ids.count(image_token) for o in outputs]


def test_token_parity_with_vllm_placeholders(
    case: FamilyCase, llm: Any, checkpoint: Path, server: ServerProcess, logs: Path, tmp_path: Path
) -> None:
    """/v1/tokens == vLLM's placeholder count over many sizes and aspect ratios: for the checkpoint
    as saved, and for each variant (a second server on a copy with other processor settings, vLLM
    with the same settings as mm_processor_kwargs)."""
    mismatches: dict[str, list[Any]] = {}
    for name, settings in {"checkpoint": {}, **{k: v.settings for k, v in case.variants.items()}}.items():
        other = None
        url = server.url
        if settings:
            other = start_server("--model", str(copy_with_processor_settings(checkpoint, tmp_path / name, **settings)),
                                 "--grpc-port", "0", log_dir=logs)
            url = other.url
        try:
            r = httpx.post(url + "/v1/tokens", json={"sizes": [list(s) for s in case.parity_sizes]}, timeout=30)
            assert r.status_code == 200, r.text
            ours = [item["num_tokens"] for item in r.json()["items"]]
        finally:
            if other is not None:
                other.stop()
        theirs = _vllm_placeholders(llm, case, case.parity_sizes, {**case.engine_processor_kwargs, **settings})
        wrong = [(s, a, b) for s, a, b in zip(case.parity_sizes, ours, theirs, strict=True) if a != b]
        if wrong:
            mismatches[name] = wrong
        if case.fixed_rows:
            assert len(set(theirs)) == 1, f"{name}: {case.name} takes a fixed N, vLLM counted {set(theirs)}"
        else:
            assert len(set(theirs)) > 2, f"{name}: the sizes should give several counts, got {set(theirs)}"
    assert not mismatches, f"(size, encode-server N, vLLM N): {mismatches}"


def test_every_family_that_declares_settings_has_request_settings_here(case: FamilyCase, client: Client) -> None:
    """The per-request cases below cover every family whose keys the server publishes."""
    keys = client.model()["mm_processor_kwargs"]["keys"]
    image_keys = {name for name, key in keys.items() if "image" in key["modalities"]}
    assert bool(image_keys) == bool(case.request_settings), (case.name, image_keys)
    for settings in case.request_settings:
        assert set(settings) <= image_keys, (case.name, settings)


def test_request_settings_give_vllms_rows_and_placeholder_counts(
    case: FamilyCase, llm: Any, client: Client, server: ServerProcess
) -> None:
    """Under each request's mm_processor_kwargs (InternVL's tile range, Gemma 3's pan-and-scan),
    as vLLM's engine takes them per request: ``/v1/tokens`` == vLLM's placeholder count over the
    parity sizes (the settings must change some), and the embedding of each test image == vLLM's
    own tower output for it under the same kwargs (its encoder cache), row for row within float32
    noise. A family that declares none refuses them. (Through encode-epd-proxy such kwargs are
    refused for a pixels + uuid family: vLLM hashes the uuid with them and never reads the store:
    test_proxy_settings.py.)"""
    from vllm import SamplingParams

    if not case.request_settings:  # a family without keys refuses any, naming it
        body = {"sizes": [[64, 64]], "mm_processor_kwargs": {"max_patches": 2}}
        r = httpx.post(server.url + "/v1/tokens", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_setting", r.text
        assert "max_patches" in r.json()["error"]["message"], r.text
        return
    report = []
    default = _vllm_placeholders(llm, case, case.parity_sizes, dict(case.engine_processor_kwargs))
    images = _images(case)
    for settings in case.request_settings:
        body = {"sizes": [list(s) for s in case.parity_sizes], "mm_processor_kwargs": settings}
        r = httpx.post(server.url + "/v1/tokens", json=body, timeout=30)
        assert r.status_code == 200, r.text
        ours = [item["num_tokens"] for item in r.json()["items"]]
        theirs = _vllm_placeholders(llm, case, case.parity_sizes, {**case.engine_processor_kwargs, **settings})
        wrong = [(s, a, b) for s, a, b in zip(case.parity_sizes, ours, theirs, strict=True) if a != b]
        assert not wrong, f"{settings}: (size, encode-server N, vLLM N) {wrong}"
        assert theirs != default, f"{settings} changed no parity size's count"
        embeddings = [e.numpy() for e in client.encode(images, mm_processor_kwargs=settings)]
        for (w, h), data, ours_rows in zip(case.sizes, images, embeddings, strict=True):
            llm.llm_engine.reset_encoder_cache()
            request = {**_request(case, pil(data), f"own-settings-{w}x{h}"),
                       "mm_processor_kwargs": {**case.engine_processor_kwargs, **settings}}
            llm.generate([request], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            cache = _runner(llm).encoder_cache
            assert len(cache) == 1, list(cache)  # the uuid is hashed with the kwargs: its one entry
            tower = next(iter(cache.values())).float().cpu().numpy()
            assert tower.shape == ours_rows.shape, (settings, (w, h), tower.shape, ours_rows.shape)
            diff, scale = float(np.abs(tower - ours_rows).max()), float(np.abs(tower).max())
            report.append(f"{settings} {w}x{h}: {tower.shape[0]} rows, max |diff| {diff:.1e} of max |x| {scale:.1f}")
            assert diff <= 1e-5 * max(1.0, scale), report[-1]
    print(f"\n{case.name}: " + "; ".join(report))
