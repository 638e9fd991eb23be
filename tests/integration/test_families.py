"""Each model family through the real ``--model PATH`` code path, over real HTTP.

The checkpoints are tiny full models (language model included) saved with ``save_pretrained``;
the server must give, bit for bit, what the full Hugging Face model gives for the same image.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from blake3 import blake3
from PIL import Image, ImageOps

from encode_server.core.wire import load_safetensors
from encode_server.encoders import FAMILIES
from tests import tiny_models
from tests.images import image_bytes
from tests.server import ServerProcess, start_server
from tests.tiny import qwen2_5_omni, qwen3_omni
from tests.tiny.records import RECORDS, TinyFamily


@dataclass(frozen=True)
class Case:
    record: TinyFamily
    kind: str  # the model type served
    args: tuple[str, ...]  # more server flags
    reference: str


# float32 named: a family vLLM consumes follows vLLM's auto, which runs a float32 checkpoint in
# bfloat16 on this CPU (test_dtype.py); the comparison here is with the float32 full model.
def _args(record: TinyFamily) -> tuple[str, ...]:
    return ("--dtype", "float32") if record.name not in ("clip", "siglip2") else ()


# One server per family that takes images, serving its record's first model type (the family's other
# model types share its adapter: tests/unit/encoders prove them), and two more: SigLIP, whose weights
# differ from CLIP's, and CLIP's pooled output. The audio families: tests/integration/test_audio.py.
IMAGE_FAMILIES = {family.name for family in FAMILIES if "image" in family.modalities}
CASES: dict[str, Case] = {
    **{record.kind: Case(record, record.kind, _args(record), record.reference) for record in RECORDS.values()
       if record.name in IMAGE_FAMILIES},
    "siglip": Case(RECORDS["clip"], "siglip", (), "clip"),
    "clip-pooled": Case(RECORDS["clip"], "clip", ("--output", "pooled"), "clip-pooled"),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, server_logs: Path
) -> Iterator[tuple[str, Path, ServerProcess]]:
    name = request.param
    case = CASES[name]
    path = case.record.builders[case.kind](tmp_path_factory.mktemp(name))
    server = start_server("--model", str(path), "--max-wait-ms", "1", *case.args, log_dir=server_logs)
    yield name, path, server
    assert server.stop() == 0, server.log()


def _decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    return (ImageOps.exif_transpose(image) or image).convert("RGB")


def _reference(name: str, path: Path, data: bytes) -> tuple[torch.Tensor, dict]:
    image = _decode(data)
    kind = CASES[name].reference
    if kind == "clip":
        return tiny_models.reference_clip_features(path, image), {}
    if kind == "clip-pooled":
        return tiny_models.reference_clip_features(path, image, output="pooled").reshape(1, -1), {}
    if kind == "llava":
        return tiny_models.reference_llava_features(path, image), {}
    if kind == "anyres":
        features = tiny_models.reference_anyres_features(path, image)
        return features, {"image_sizes": [image.height, image.width]}
    if kind == "mistral3":
        features = tiny_models.reference_mistral3_features(path, image)
        return features, {}
    if kind == "gemma3":
        return tiny_models.reference_gemma3_features(path, [image])[0], {}
    if kind == "gemma4":
        return tiny_models.reference_gemma4_features(path, [image])[0], {}
    if kind == "internvl":
        [features] = tiny_models.reference_internvl_features(path, [image])
        return features, {"image_num_patches": features.shape[0] // 4}
    if kind == "llama4":  # 4 rows a tile: 16 patches pixel-shuffled by 0.5
        features = tiny_models.reference_llama4_features(path, image)
        return features, {"patches_per_image": features.shape[0] // 4}
    if kind == "kimi_k25":
        features = tiny_models.reference_kimi_k25_features(path, image)
        return features, {}
    if kind in ("qwen2_5_omni", "qwen3_omni"):
        omni = qwen2_5_omni if kind == "qwen2_5_omni" else qwen3_omni
        features, grid = omni.reference_image_features(path, image)
        return features, {"image_grid_thw": grid}
    reference = tiny_models.reference_qwen3_features if kind == "qwen3" else tiny_models.reference_qwen_features
    features, grid = reference(path, image)
    return features, {"image_grid_thw": grid}


def _tensor(item: dict) -> torch.Tensor:
    assert item["dtype"] == "float32"
    raw = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").copy()
    return torch.from_numpy(raw).reshape(item["shape"])


def _encode(server: ServerProcess, items: list[dict], accept: str = "application/json") -> httpx.Response:
    r = httpx.post(server.url + "/v1/encode", json={"items": items}, headers={"Accept": accept}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_server_equals_the_full_model_and_hash_only_hits(family: tuple[str, Path, ServerProcess]) -> None:
    name, path, server = family
    for fmt, size, seed in (("PNG", (61, 47), 1), ("JPEG", (120, 90), 2), ("PNG", (30, 200), 3)):
        data = image_bytes(fmt, *size, seed=seed)
        mm_hash = blake3(data).hexdigest()
        item = _encode(server, [{"data": base64.b64encode(data).decode()}]).json()["items"][0]
        assert (item["status"], item["source"], item["hash"]) == ("encoded", "encoder", mm_hash)
        expected, meta = _reference(name, path, data)
        got = _tensor(item)
        assert got.shape == expected.shape, (name, fmt)
        if CASES[name].reference == "kimi_k25":
            # The server runs vLLM's formulation (fused QKV, RoPE on interleaved pairs, the position
            # grid resized with interpolate), transformers its own (split, permuted QKV, half-split
            # RoPE, an embedding_bag of bicubic weights): the same arithmetic up to float rounding.
            assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max()), name
        else:
            assert torch.equal(got, expected.float()), f"{name}: numeric drift, max {(got - expected).abs().max()}"
        assert item["num_tokens"] == expected.shape[0]
        for key, value in meta.items():
            assert item["meta"][key] == value

        hit = _encode(server, [{"hash": mm_hash}]).json()["items"][0]
        assert (hit["status"], hit["source"]) == ("hit", "local")
        assert hit["embedding"] == item["embedding"]

        st = _encode(server, [{"hash": mm_hash}], accept="application/vnd.safetensors")
        tensors, metadata = load_safetensors(st.content)
        assert tensors["0"].data == base64.b64decode(item["embedding"])
        assert json.loads(metadata["items"])[0]["shape"] == item["shape"]


def test_model_reports_its_family(family: tuple[str, Path, ServerProcess]) -> None:
    name, path, server = family
    model = httpx.get(server.url + "/v1/model").json()
    assert model["model"] == model["id"] == str(path)
    assert model["kind"] == CASES[name].kind
    assert model["meaningless"] is False
    item = _encode(server, [{"data": base64.b64encode(image_bytes("PNG", 64, 64, seed=9)).decode()}]).json()
    assert item["items"][0]["shape"][-1] == model["hidden_size"]


def test_token_counts_follow_the_processor(family: tuple[str, Path, ServerProcess]) -> None:
    """Qwen: N varies with the image and equals the processor's grid / merge**2; InternVL: N is its
    tiles x rows a tile; the others: fixed N."""
    name, path, server = family
    from transformers import AutoImageProcessor

    family = next(f for f in FAMILIES if f.name == CASES[name].record.name)
    processor = (family.processor or AutoImageProcessor.from_pretrained)(path)  # Llama 4's: torchvision-free
    counts = set()
    for w, h in ((56, 56), (100, 60), (224, 224), (300, 120), (57, 333), (640, 480)):
        data = image_bytes("PNG", w, h, seed=w * h)
        item = _encode(server, [{"data": base64.b64encode(data).decode()}]).json()["items"][0]
        counts.add(item["num_tokens"])
        if CASES[name].reference in ("qwen", "qwen3"):
            grid = processor(images=_decode(data), return_tensors="pt")["image_grid_thw"][0].tolist()
            assert item["meta"]["image_grid_thw"] == grid
            assert item["num_tokens"] == int(np.prod(grid)) // processor.merge_size**2
        if name == "siglip2":  # NaFlex: the image's own patches, up to max_num_patches
            shapes = processor(images=_decode(data), return_tensors="pt")["spatial_shapes"][0]
            assert item["num_tokens"] == int(shapes.prod()) <= processor.max_num_patches
        if name == "internvl":
            tiles = processor(images=_decode(data), crop_to_patches=True)["num_patches"][0]
            assert item["meta"] == {"image_num_patches": tiles}
            assert item["num_tokens"] == tiles * 4
    if CASES[name].record.variable_tokens:
        # The tiny SigLIP2 takes at most 24 patches an image: two counts among these sizes.
        assert len(counts) > (1 if name == "siglip2" else 3), "sizes should give different token counts"
    else:
        assert len(counts) == 1, f"{name} is fixed-resolution, got N in {counts}"


def test_tokens_preflight_equals_encode(family: tuple[str, Path, ServerProcess]) -> None:
    """/v1/tokens (uploads and sizes) gives the num_tokens and meta that /v1/encode returns."""
    _, _, server = family
    sizes = ((56, 56), (100, 60), (300, 120), (57, 333), (640, 480))
    images = [image_bytes("PNG", w, h, seed=w * h) for w, h in sizes]
    encoded = _encode(server, [{"data": base64.b64encode(d).decode()} for d in images]).json()["items"]
    by_upload = httpx.post(server.url + "/v1/tokens", files=[("f", (f"{i}.png", d)) for i, d in enumerate(images)])
    by_size = httpx.post(server.url + "/v1/tokens", json={"sizes": [list(s) for s in sizes]})
    for counted in (by_upload.json()["items"], by_size.json()["items"]):
        assert [(c["num_tokens"], c["meta"]) for c in counted] == [(e["num_tokens"], e["meta"]) for e in encoded]
