"""builtin:tiny: no download, the real dynamic-resolution path, the same weights in every process."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from encode_server.encoders import load_encoder
from tests.unit.encoders.util import decode, noise_image

DIGEST_SCRIPT = (
    "from encode_server.encoders import load_encoder; print(load_encoder('builtin:tiny').info.weights_digest)"
)


def test_another_process_loads_bit_identical_weights() -> None:
    here = load_encoder("builtin:tiny", device="cpu")
    there = subprocess.run([sys.executable, "-c", DIGEST_SCRIPT], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == here.info.weights_digest
    assert load_encoder("builtin:tiny", device="cpu").info.weights_digest == here.info.weights_digest


def test_says_it_is_meaningless_and_what_it_is() -> None:
    info = load_encoder("builtin:tiny").info
    assert info.meaningless
    assert (info.model_id, info.kind, info.output, info.hidden_size) == ("builtin:tiny", "qwen2_5_vl", "merged", 128)
    assert (info.device, info.dtype) == ("cpu", "float32")  # device "auto" without CUDA
    assert info.preprocessing["size"]["longest_edge"] == 448 * 448


def test_dynamic_resolution_and_bounded_token_count() -> None:
    encoder = load_encoder("builtin:tiny")
    small, large = encoder.preprocess(noise_image(100, 70)), encoder.preprocess(noise_image(4000, 3000))
    assert small.num_tokens < large.num_tokens <= 448 * 448 // 28**2
    for prepared, encoded in zip([small, large], encoder.forward([small, large]), strict=True):
        assert encoded.shape == (prepared.num_tokens, 128)
        assert torch.isfinite(decode(encoded)).all()
    assert encoder.count_tokens(4000, 3000) == (large.num_tokens, large.meta)


def test_loading_leaves_the_callers_random_state_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    load_encoder("builtin:tiny")
    assert torch.equal(torch.rand(3), expected)


def test_preprocess_is_thread_safe() -> None:
    encoder = load_encoder("builtin:tiny")
    images = [noise_image(40 + 37 * i, 300 - 23 * i, seed=i) for i in range(12)]
    serial = [encoder.preprocess(image) for image in images]
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(encoder.preprocess, images * 4))
    for i, prepared in enumerate(threaded):
        expected = serial[i % len(images)]
        assert prepared.meta == expected.meta
        assert torch.equal(prepared.inputs["pixel_values"], expected.inputs["pixel_values"])
