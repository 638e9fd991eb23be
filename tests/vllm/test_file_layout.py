"""No plugin at all: vLLM's stock ``ECExampleConnector`` reads what encode-server wrote with
``--export-dir`` (``DIR/<mm_hash>/encoder_cache.safetensors``, tensor ``ec_cache``).

The oracle (same tokens as the embedding given directly) and the negative control (zeros in the
file change them). A missing file is no negative control here: the stock connector then runs its
own encoder when the request has pixels, so the control replaces the file instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from encode_client import Client

from tests.server import ServerProcess, start_server
from tests.vllm.conftest import direct_embeds, engine, greedy, metadata_only, png

SIZES = [(56, 56), (112, 84), (150, 100), (300, 260)]
IMAGES = [png(w, h, seed=50 + i) for i, (w, h) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ec-files")


@pytest.fixture(scope="module")
def server(model_dir: Path, export_dir: Path, logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--model", str(model_dir), "--export-dir", str(export_dir), "--grpc-port", "0", "--dtype", "float32",
        log_dir=logs,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(model_dir: Path, export_dir: Path, server: ServerProcess) -> Iterator[Any]:
    config = {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": str(export_dir)},
    }
    with engine(model_dir, config) as llm:
        yield llm


def test_stock_connector_reads_exported_files(llm: Any, server: ServerProcess, export_dir: Path) -> None:
    import safetensors.torch

    with Client(server.url, response="json") as client:
        handed = client.hand_off(IMAGES)  # no Redis: the export alone is the shared tier
        embeddings = [r.numpy() for r in client.encode(IMAGES)]
    grids = [r.meta["image_grid_thw"] for r in handed]
    hashes = [r.hash for r in handed]
    for h, emb in zip(hashes, embeddings, strict=True):
        on_disk = safetensors.torch.load_file(export_dir / h / "encoder_cache.safetensors")
        assert set(on_disk) == {"ec_cache"}
        assert np.array_equal(on_disk["ec_cache"].numpy(), emb)

    via_files = greedy(llm, [metadata_only(g, h) for g, h in zip(grids, hashes, strict=True)])
    assert via_files == greedy(llm, [direct_embeds(e, g) for e, g in zip(embeddings, grids, strict=True)])

    import torch

    for h, emb in zip(hashes, embeddings, strict=True):
        safetensors.torch.save_file({"ec_cache": torch.zeros(emb.shape)}, export_dir / h / "encoder_cache.safetensors")
    llm.llm_engine.reset_encoder_cache()
    zeros = greedy(llm, [metadata_only(g, h) for g, h in zip(grids, hashes, strict=True)])
    assert zeros == greedy(llm, [direct_embeds(np.zeros_like(e), g) for e, g in zip(embeddings, grids, strict=True)])
    for i, (zero, real) in enumerate(zip(zeros, via_files, strict=True)):
        assert zero != real, f"image {i}: zeros in the file gave the same tokens"
