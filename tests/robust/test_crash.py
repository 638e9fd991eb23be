"""SIGKILL the server while its write-behind queue and metadata hand-offs are busy: no partially
written value is ever read back as valid (every stored value parses and validates, or is absent),
and a restarted server serves correct hits from what survived."""

from __future__ import annotations

import base64
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
from encode_client.store import parse_value

from tests.calls import b64, h
from tests.images import image_bytes
from tests.redis_procs import start_redis
from tests.robust.conftest import ROBUST_ARGS
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration


def test_sigkill_during_write_behind_and_hand_off_leaves_only_valid_values(
    robust_server: ServerProcess, robust_logs
) -> None:
    prefix = f"crash-{uuid.uuid4().hex[:8]}"
    images = [image_bytes("PNG", 64 + (i % 8) * 24, 64 + (i // 8) * 16, seed=110_000 + i) for i in range(48)]
    with start_redis() as redis_proc:
        args = (*ROBUST_ARGS, "--redis-url", redis_proc.url, "--cache-prefix", prefix, "--max-wait-ms", "2")
        server = start_server(*args, log_dir=robust_logs)
        fingerprint = httpx.get(server.url + "/v1/model").json()["fingerprint"]
        stop = threading.Event()
        sent = {"behind": 0, "hand_off": 0}

        def load(kind: str, offset: int) -> None:
            i = offset
            with httpx.Client(base_url=server.url, timeout=30) as client:
                while not stop.is_set():
                    batch = [images[(i + k) % len(images)] for k in range(4)]
                    body = {"items": [{"data": b64(d)} for d in batch]}
                    if kind == "hand_off":
                        body["return"] = "metadata"
                    try:
                        client.post("/v1/encode", json=body)
                        sent[kind] += 1
                    except httpx.TransportError:
                        return  # the server is gone
                    i += 4

        workers = [threading.Thread(target=load, args=(kind, 12 * n))
                   for n, kind in enumerate(["behind", "hand_off", "behind", "hand_off"])]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 20
        while sum(sent.values()) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.proc.kill()  # SIGKILL: no drain, no flush
        server.proc.wait(10)
        stop.set()
        for w in workers:
            w.join(30)
        assert sent["behind"] and sent["hand_off"], sent

        client = redis_proc.client()
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        assert keys, "nothing was written before the kill"
        for key in keys:
            value = parse_value(key.decode(), client.get(key), fingerprint=fingerprint)  # raises if partial
            assert value.shape[0] >= 1
        stored = {k.decode().rsplit(":", 1)[1] for k in keys}

        # A generous Redis timeout: on a loaded machine a read past the default 150 ms is a miss
        # (by design), which is not what this test is about.
        restarted = start_server(*args, "--cache-mb", "0", "--redis-timeout-ms", "3000", log_dir=robust_logs)
        try:
            items = httpx.post(restarted.url + "/v1/encode", json={"items": [{"hash": h(d)} for d in images[:8]]},
                               timeout=60).json()["items"]
            hits = 0
            for data, item in zip(images[:8], items, strict=True):
                if item["hash"] not in stored:
                    assert item["status"] == "miss"
                    continue
                assert (item["status"], item["source"]) == ("hit", "redis")
                hits += 1
                ref = httpx.post(robust_server.url + "/v1/encode", json={"items": [{"data": b64(data)}]},
                                 timeout=60).json()["items"][0]
                got = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
                want = np.frombuffer(base64.b64decode(ref["embedding"]), "<f4")
                assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
            assert hits, "no hit survived the kill"
        finally:
            assert restarted.stop() == 0, restarted.log()[-3000:]
        print(f"{len(keys)} values after SIGKILL ({sent}), all valid; {hits} hits after restart")
