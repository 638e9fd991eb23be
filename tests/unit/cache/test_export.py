"""``--export-dir``: vLLM's stock EC file layout, atomic, within a disk budget, one model per dir."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from encode_server.cache.export import FILE_NAME, FileExporter, check_directory
from encode_server.config import settings_from
from encode_server.core.types import Embedding, EncodedTensor

FP = "cd" * 32


def _embedding(rows: int, seed: int = 0, dim: int = 16) -> Embedding:
    array = np.random.default_rng(seed).standard_normal((rows, dim)).astype("<f4")
    return Embedding(EncodedTensor(array.tobytes(), (rows, dim), "float32"), {"image_grid_thw": [1, 2, 2 * rows]})


def _hash(i: int) -> str:
    return f"{i:064x}"


def _export(exporter: FileExporter, items: list[tuple[str, Embedding]]) -> None:
    asyncio.run(exporter.export(items))


def test_file_is_what_vllms_example_connector_loads(tmp_path: Path) -> None:
    exporter = FileExporter(tmp_path, 1 << 20, FP)
    emb = _embedding(5)
    _export(exporter, [(_hash(1), emb)])
    tensors = load_file(tmp_path / _hash(1) / FILE_NAME)  # what ECExampleConnector calls
    assert set(tensors) == {"ec_cache"}
    expected = torch.frombuffer(bytearray(emb.tensor.data), dtype=torch.float32).reshape(5, 16)
    assert torch.equal(tensors["ec_cache"], expected)
    assert not list((tmp_path / _hash(1)).glob(".*.tmp")), "no temporary file is left behind"
    exporter.close()


def test_budget_evicts_oldest_first_and_reuse_refreshes(tmp_path: Path) -> None:
    probe = FileExporter(tmp_path / "probe", 1 << 20, FP)
    _export(probe, [(_hash(0), _embedding(4))])
    size = probe.bytes  # one file, header included
    probe.close()
    exporter = FileExporter(tmp_path / "dir", 3 * size, FP)
    tmp_path = tmp_path / "dir"
    for i in range(3):
        _export(exporter, [(_hash(i), _embedding(4, seed=i))])
    assert len(exporter) == 3 and exporter.bytes <= 3 * size
    _export(exporter, [(_hash(0), _embedding(4, seed=0))])  # re-used: now the youngest
    _export(exporter, [(_hash(3), _embedding(4, seed=3))])  # over budget: the oldest (1) goes
    present = {i for i in range(4) if (tmp_path / _hash(i) / FILE_NAME).exists()}
    assert present == {0, 2, 3}
    assert not (tmp_path / _hash(1)).exists()
    assert exporter.evicted == 1 and exporter.bytes <= 3 * size
    exporter.close()


def test_files_already_there_count_against_the_budget(tmp_path: Path) -> None:
    first = FileExporter(tmp_path, 1 << 20, FP)
    for i in range(4):
        _export(first, [(_hash(i), _embedding(4, seed=i))])
        os.utime(tmp_path / _hash(i) / FILE_NAME, (time.time() + i, time.time() + i))  # distinct ages
    per_file = first.bytes // 4
    first.close()
    (tmp_path / _hash(0) / f".{FILE_NAME}.1.2.tmp").write_bytes(b"half a write")
    again = FileExporter(tmp_path, 2 * per_file, FP)  # a smaller budget at restart: the two oldest go
    assert len(again) == 2 and again.bytes == 2 * per_file
    assert [i for i in range(4) if (tmp_path / _hash(i) / FILE_NAME).exists()] == [2, 3]
    assert not list(tmp_path.glob(f"*/.{FILE_NAME}.*.tmp")), "stale temporaries are removed"
    again.close()


def test_a_directory_of_another_model_is_refused(tmp_path: Path) -> None:
    FileExporter(tmp_path, 1 << 20, FP).close()
    with pytest.raises(ValueError, match="another model"):
        FileExporter(tmp_path, 1 << 20, "ef" * 32)
    FileExporter(tmp_path, 1 << 20, FP).close()  # the same model comes back to its directory


def test_writes_behind_and_an_embedding_larger_than_the_budget(tmp_path: Path) -> None:
    exporter = FileExporter(tmp_path, 4096, FP)
    exporter.export_behind([(_hash(7), _embedding(2)), (_hash(8), _embedding(1000))])
    exporter.close()  # waits for the queued writes
    assert (tmp_path / _hash(7) / FILE_NAME).exists()
    assert not (tmp_path / _hash(8) / FILE_NAME).exists()


def test_settings_refuse_export_with_tenant_isolation(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="tenant"):
        settings_from(["--export-dir", str(tmp_path), "--tenant-isolation"])
    with pytest.raises(SystemExit, match="export-max-mb"):
        settings_from(["--export-dir", str(tmp_path), "--export-max-mb", "0"])
    assert settings_from(["--export-dir", str(tmp_path)]).export_max_bytes == 10240 * 1024 * 1024


def test_the_export_directory_is_made_or_refused_before_a_port_opens(tmp_path: Path) -> None:
    check_directory(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        check_directory(tmp_path / "file" / "under")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match="not writable"):
            check_directory(locked)
