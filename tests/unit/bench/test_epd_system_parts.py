"""The end-to-end benchmark's own arithmetic and request streams (bench/flops.py, epd_workloads.py,
epd_fronts.py): what its figures stand on, checked without starting a server."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench.epd_fronts import encoder_request, has_mm_input
from bench.epd_system import MAX_PIXELS, MODELS
from bench.epd_workloads import SIZES, write_workloads
from bench.flops import QWEN2_5_VL_7B, Request, grid, request_flops, text_flops, tower_share


@pytest.mark.parametrize("size", [*SIZES, (56, 56), (30, 2000), (4000, 3000)])
@pytest.mark.parametrize("max_pixels", [MAX_PIXELS, 12_845_056])
def test_the_grid_is_qwens_own_resize(size: tuple[int, int], max_pixels: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    width, height = size
    h, w = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=max_pixels)
    assert grid(width, height, max_pixels=max_pixels) == (h // 14, w // 14)


def test_the_language_models_count_is_twice_its_weights_per_token() -> None:
    text = QWEN2_5_VL_7B["text_config"]
    d, kv = text["hidden_size"], 512
    weights = text["num_hidden_layers"] * (2 * d * d + 2 * d * kv + 3 * d * text["intermediate_size"])
    one = text_flops(text, 1, 1)
    assert one == pytest.approx(2 * weights + 2 * d * text["vocab_size"], rel=1e-3)
    assert weights == pytest.approx(6.5e9, rel=0.05)  # Qwen2.5-VL-7B's language model without embeddings


def test_the_tower_grows_with_the_image_and_its_share_with_it() -> None:
    small, large = (request_flops(QWEN2_5_VL_7B, Request(w, h, 40, 16)) for w, h in ((448, 448), (1280, 720)))
    assert large[0] > 4 * small[0]
    assert small[0] / sum(small) < large[0] / sum(large) < 0.5


def test_the_benchmarks_models_have_the_shares_they_are_named_for(tmp_path: Path) -> None:
    workloads = write_workloads(tmp_path, 16, 16)
    requests = workloads["unique"].requests
    real = tower_share(QWEN2_5_VL_7B, requests, MAX_PIXELS)
    assert 0.15 < real < 0.35
    assert tower_share(MODELS["qwen7b"].config(), requests, MAX_PIXELS) == pytest.approx(real, abs=0.02)
    assert tower_share(MODELS["tower79"].config(), requests, MAX_PIXELS) == pytest.approx(0.79, abs=0.02)


def test_the_workloads_reuse_what_they_say(tmp_path: Path) -> None:
    made = write_workloads(tmp_path, 24, 8, seed=3)
    again = write_workloads(tmp_path / "again", 24, 8, seed=3)

    def lines(name: str, where: dict) -> list[dict]:
        return [json.loads(x) for x in where[name].path.read_text().splitlines()]

    def images(name: str) -> list[str]:
        return [Path(line["content"][0]["image_url"]["url"]).name for line in lines(name, made)]

    assert [x["content"][1] for x in lines("popular", made)] == [x["content"][1] for x in lines("popular", again)]
    unique, popular, multiturn = images("unique"), images("popular"), images("multiturn")
    assert len(unique) == len(set(unique)) == 24 == made["unique"].images
    assert len(popular) == 24 and made["popular"].images == len(set(popular)) < 24
    assert max(popular.count(i) for i in set(popular)) >= 3  # Zipf: a hot image
    assert len(set(multiturn)) == made["multiturn"].images == 6
    texts: dict[str, list[str]] = {}
    for line in lines("multiturn", made):
        texts.setdefault(line["content"][0]["image_url"]["url"], []).append(line["content"][1]["text"])
    for turns in texts.values():  # each turn re-sends the image after the whole history so far
        assert len(turns) == 4 and all(b.startswith(a) and len(b) > len(a) for a, b in itertools.pairwise(turns))
    sizes = {(r.width, r.height) for r in made["unique"].requests}
    assert sizes <= set(SIZES) and len(sizes) > 1
    for path in tmp_path.glob("*.jpg"):
        assert path.read_bytes()[:2] == b"\xff\xd8"


def test_vllms_epd_proxy_primes_its_encoder_with_the_chat_cut_to_one_token() -> None:
    chat = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 64,
            "max_completion_tokens": 64,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    primer = encoder_request(chat)
    assert primer["max_tokens"] == primer["max_completion_tokens"] == 1 and primer["stream"] is False
    assert "stream_options" not in primer and primer["messages"] == chat["messages"]
    assert chat["max_tokens"] == 64 and chat["stream"] is True  # the original goes on as it was
    assert has_mm_input(chat)
    assert not has_mm_input({"messages": [{"role": "user", "content": "hello"}]})
    assert not has_mm_input({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
