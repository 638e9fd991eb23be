"""``--preprocess-processes``: images decoded and preprocessed in worker processes give the rows the
server's own threads give, refuse bad images the same way, and a worker that dies costs only the
requests it had in flight."""

from __future__ import annotations

import base64
import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from encode_server.core.errors import BadInput, TooLarge, Unavailable
from tests.images import image_bytes
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration

PROCESSES = 2


@pytest.fixture(scope="module")
def pair(server_logs: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The same model twice: workers, and the threads alone (both builtin:tiny, a Qwen2-VL)."""
    procs = start_server("--preprocess-processes", str(PROCESSES), log_dir=server_logs, timeout=300)
    threads = start_server(log_dir=server_logs)
    yield procs, threads
    assert procs.stop() == 0, procs.log()
    assert threads.stop() == 0, threads.log()


def _encode(server: ServerProcess, *images: bytes) -> httpx.Response:
    body = {"items": [{"data": base64.b64encode(d).decode()} for d in images]}
    return httpx.post(server.url + "/v1/encode", json=body, timeout=60)


def _workers(server: ServerProcess) -> list[int]:
    """The server's preprocessing workers: its children that multiprocessing spawned (not the
    resource tracker beside them)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == server.proc.pid and b"spawn_main" in command:
            children.append(int(stat.parent.name))
    return children


def test_a_workers_rows_are_the_threads_rows(pair: tuple[ServerProcess, ServerProcess]) -> None:
    procs, threads = pair
    images = [image_bytes("JPEG", 64 + 8 * i, 48, seed=900 + i) for i in range(3)]
    images.append(image_bytes("PNG", 50, 70, seed=904))
    for data in images:  # one at a time: each its own batch on both (a batch's make-up moves the last bits)
        ours, theirs = _encode(procs, data), _encode(threads, data)
        assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
        mine, other = ours.json()["items"][0], theirs.json()["items"][0]
        assert mine["status"] == other["status"] == "encoded"
        for field in ("embedding", "num_tokens", "shape", "meta"):
            assert mine[field] == other[field], field
    assert len(_workers(procs)) == PROCESSES


def test_a_bad_image_is_refused_by_a_worker_naming_the_item(pair: tuple[ServerProcess, ServerProcess]) -> None:
    procs, _ = pair
    good = image_bytes("PNG", 40, 40, seed=910)
    r = _encode(procs, good, b"\xff\xd8\xff\xe0 not a jpeg")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_image" and r.json()["error"]["index"] == 1
    assert _encode(procs, good).status_code == 200


def test_a_killed_worker_costs_only_its_requests(pair: tuple[ServerProcess, ServerProcess]) -> None:
    procs, _ = pair
    victims = _workers(procs)
    assert victims
    for pid in victims:  # every worker: the next image finds the pool broken, whichever worker it had
        os.kill(pid, signal.SIGKILL)
    codes = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = _encode(procs, image_bytes("PNG", 32, 32, seed=920 + len(codes)))
        codes.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded", r.text
        assert int(r.headers["Retry-After"]) >= 1
        time.sleep(0.5)
    assert codes[-1] == 200, codes
    assert set(_workers(procs)).isdisjoint(victims)  # a new pool, new workers
    assert procs.proc.poll() is None


@pytest.mark.parametrize("error", [
    BadInput("not a recognised image file", type="invalid_image", index=3),
    TooLarge("too many pixels", type="image_too_large", index=0),
    Unavailable("busy", type="overloaded", index=None, retry_after=2.5),
])
def test_a_refusal_crosses_a_process_whole(error: Exception) -> None:
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and back.__dict__ == error.__dict__ and str(back) == str(error)
