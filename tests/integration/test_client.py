"""The client package against real servers: two bf16 replicas over HTTP and gRPC, the CLI."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from blake3 import blake3
from encode_client import AsyncClient, Client, rank_replicas

from tests.calls import metric
from tests.images import image_bytes
from tests.integration.conftest import start_servers
from tests.integration.test_encode_api import forwarded_images
from tests.server import ServerProcess, free_port
from tests.tools import require_tool


@pytest.fixture(scope="module")
def replicas(server_logs: Path) -> Iterator[list[ServerProcess]]:
    """Two bf16 replicas on CPU (bf16 must survive every transport and response kind)."""
    servers = start_servers(*[["--dtype", "bfloat16", "--max-wait-ms", "1"]] * 2, log_dir=server_logs)
    yield servers
    for server in servers:
        server.stop()


def _images(n: int, seed: int) -> list[bytes]:
    return [image_bytes("PNG", 40 + i, 30 + i % 5, seed=seed + i) for i in range(n)]


def _first_choice(image: bytes, urls: list[str]) -> str:
    return rank_replicas(blake3(image).hexdigest(), urls)[0]


def _images_until(n: int, seed: int, holds: Callable[[list[bytes]], bool]) -> list[bytes]:
    """The first of ``n`` images (seeds ``seed``, ``seed + 1``, ...) for which ``holds`` is true:
    rendezvous ranking depends on the replicas' random ports, so no fixed set always qualifies."""
    for attempt in range(50):
        images = _images(n, seed + 1000 * attempt)
        if holds(images):
            return images
    raise AssertionError(f"no {n} images in 50 tries satisfy the condition")


def test_hash_first_uploads_each_miss_once(replicas: list[ServerProcess]) -> None:
    server = replicas[0]
    images = _images(4, seed=100)
    uploaded, encoded = metric(server, "encode_server_upload_bytes_total"), forwarded_images(server)
    with Client(server.url) as client:
        first = client.encode([*images, images[0]])
        assert [r.status for r in first] == ["encoded"] * 5 and first[4].data == first[0].data
        assert metric(server, "encode_server_upload_bytes_total") - uploaded == sum(map(len, images))
        assert forwarded_images(server) - encoded == 4
        again = client.encode(images)
    assert [(r.status, r.source) for r in again] == [("hit", "local")] * 4
    assert metric(server, "encode_server_upload_bytes_total") - uploaded == sum(map(len, images))
    assert [r.hash for r in again] == [blake3(i).hexdigest() for i in images]


def test_tensors_are_byte_identical_across_transports_and_kinds(replicas: list[ServerProcess]) -> None:
    server = replicas[0]
    images = _images(3, seed=200)
    with Client(server.url) as c:
        safetensors = c.encode(images)
    with Client(server.url, response="json") as c:
        as_json = c.encode(images)
    with Client("grpc://" + server.grpc_target) as c:
        over_grpc = c.encode(images)

    async def async_both() -> tuple[list, list]:
        async with AsyncClient(server.url) as a, AsyncClient("grpc://" + server.grpc_target) as g:
            return await a.encode(images), await g.encode(images)

    async_http, async_grpc = asyncio.run(async_both())
    for results in (as_json, over_grpc, async_http, async_grpc):
        assert [(r.data, r.shape, r.dtype, r.meta) for r in results] == [
            (r.data, r.shape, r.dtype, r.meta) for r in safetensors
        ]
    with Client(server.url) as c:
        model = c.model()
    for results in (safetensors, as_json, over_grpc, async_http, async_grpc):  # each answer names its model
        assert {(r.model, r.fingerprint) for r in results} == {(model["model"], model["fingerprint"])}
    r = safetensors[0]
    assert r.dtype == "bfloat16" and len(r.data) == np.prod(r.shape) * 2
    tensor = r.torch()
    assert tensor.dtype == torch.bfloat16 and tuple(tensor.shape) == r.shape
    assert np.array_equal(r.numpy(), tensor.float().numpy())
    assert r.meta["image_grid_thw"][0] == 1 and r.num_tokens == r.shape[0]


def test_same_image_always_lands_on_the_same_replica(replicas: list[ServerProcess]) -> None:
    urls = [s.url for s in replicas]
    images = _images_until(12, 300, lambda ims: {_first_choice(i, urls) for i in ims} == set(urls))
    with Client(urls) as client:
        results = client.encode(images)
        for r in results:
            assert r.replica == rank_replicas(r.hash, urls)[0]
        assert {r.replica for r in results} == set(urls), "these 12 images rank both replicas first"
        assert [r.status for r in client.encode(images)] == ["hit"] * 12
    for server in replicas:
        with Client(server.url) as one:
            cached = [f.cached for f in one.lookup([r.hash for r in results])]
        assert cached == [r.replica == server.url for r in results]


def test_cli_hash_equals_b3sum(tmp_path: Path) -> None:
    files = []
    for i, data in enumerate([*_images(3, seed=400), b"", b"not an image"]):
        files.append(tmp_path / f"f{i}.bin")
        files[-1].write_bytes(data)
    out = subprocess.run([sys.executable, "-m", "encode_client.cli", "hash", *map(str, files)],
                         check=True, capture_output=True, text=True).stdout
    ours = [line.split()[0] for line in out.splitlines()]
    assert ours == [blake3(f.read_bytes()).hexdigest() for f in files]  # the blake3 reference package
    b3sum = require_tool("b3sum")
    theirs = subprocess.run([b3sum, *map(str, files)], check=True, capture_output=True, text=True).stdout
    assert ours == [line.split()[0] for line in theirs.splitlines()]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "encode_client.cli", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_warm_encode_lookup_and_exit_codes(replicas: list[ServerProcess], tmp_path: Path) -> None:
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    images = _images(7, seed=500)
    for i, data in enumerate(images):
        (folder / ("sub" if i % 2 else "") / f"{i}.png").write_bytes(data)
    (folder / "notes.txt").write_text("not an image")
    urls = [arg for s in replicas for arg in ("--url", s.url)]
    first = _cli(*urls, "warm", str(folder), "--concurrency", "3")
    assert first.returncode == 0, first.stderr
    assert "warmed 7 images" in first.stderr and "0 hits, 7 misses" in first.stderr and "img/s" in first.stderr
    second = _cli(*urls, "warm", str(folder))
    assert second.returncode == 0 and "7 hits, 0 misses" in second.stderr, second.stderr

    out = tmp_path / "out.safetensors"
    files = [str(folder / "0.png"), str(folder / "sub" / "1.png")]
    encoded = _cli(*urls, "encode", *files, "-o", str(out))
    assert encoded.returncode == 0, encoded.stderr
    from safetensors import safe_open  # the reference reader (a server dependency)

    with safe_open(str(out), "pt") as f:
        items = json.loads(f.metadata()["items"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert [i["status"] for i in items] == ["hit", "hit"] and sorted(tensors) == ["0", "1"]
    assert tensors["0"].dtype == torch.bfloat16 and list(tensors["0"].shape) == items[0]["shape"]
    looked = _cli(*urls, "lookup", files[0], blake3(images[1]).hexdigest(), "00" * 32)
    assert looked.returncode == 0
    assert [line.split()[1] for line in looked.stdout.splitlines()] == ["cached", "cached", "missing"]

    assert _cli(*urls, "encode", str(tmp_path / "missing.png"), "-o", str(out)).returncode == 2
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG broken")
    refused = _cli(*urls, "encode", str(bad), "-o", str(out))
    assert refused.returncode == 1 and "invalid_image" in refused.stderr
    down = _cli("--url", f"http://127.0.0.1:{free_port()}", "lookup", "00" * 32)  # bound and closed: nothing listens
    assert down.returncode == 3 and "no replica answered" in down.stderr


def test_pip_install_without_torch_encodes(replicas: list[ServerProcess], tmp_path: Path) -> None:
    """``pip install ./clients/python`` into a fresh venv (no torch, no server) and encode."""
    source = tmp_path / "src"
    shutil.copytree(Path(__file__).resolve().parents[2] / "clients" / "python", source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=60)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(source)], capture_output=True, text=True,
                         timeout=120)
    assert pip.returncode == 0, f"pip install ./clients/python failed:\n{pip.stdout[-3000:]}\n{pip.stderr[-3000:]}"
    image = tmp_path / "x.png"
    image.write_bytes(image_bytes("PNG", 45, 45, seed=700))
    code = (
        "import importlib.util, sys; from encode_client import Client;"
        "assert importlib.util.find_spec('torch') is None and 'encode_server' not in sys.modules;"
        f"r = Client({replicas[0].url!r}).encode([{str(image)!r}])[0];"
        "print(r.status, r.dtype, r.numpy().shape)"
    )
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["encoded", "bfloat16"]


def test_with_one_replica_stopped_requests_fail_over(replicas: list[ServerProcess]) -> None:
    """Last in the module: it stops replica 1."""
    urls = [s.url for s in replicas]
    images = _images_until(8, 600, lambda ims: any(_first_choice(i, urls) == urls[1] for i in ims))
    replicas[1].stop()
    with Client(urls) as client:
        results = client.encode(images)
    assert [r.status for r in results] == ["encoded"] * 8
    assert {r.replica for r in results} == {urls[0]}
