"""The client without an encode-server: public surface, retries against a real loopback HTTP
server, rendezvous choice, the prefix key, and the generated gRPC code."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import encode_client
import pytest
from encode_client import Client, PrefixKeyError, RetryPolicy, ServerError, image_aware_ids, rank_replicas
from encode_client._retry import Backoff

from tests.server import free_port

ROOT = Path(__file__).resolve().parents[3]


def test_public_surface_is_exactly_all() -> None:
    # Submodules (cli, prefix_key, store) appear as attributes once imported; they are not names
    # the package exports.
    public = {
        name
        for name, value in vars(encode_client).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(encode_client.__all__) - {"__version__"}
    for name in encode_client.__all__:
        assert getattr(encode_client, name) is not None
    for path in (ROOT / "clients/python/encode_client").rglob("*.py"):  # never imports the server
        assert not re.search(r"^\s*(from|import) encode_server\b", path.read_text(), re.M), path


def test_generated_grpc_code_matches_the_proto(tmp_path: Path) -> None:
    """`make proto` output is checked in: regenerate and compare byte for byte."""
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_proto.py"), "--out", str(tmp_path)], check=True)
    from scripts.gen_proto import GENERATED, TARGETS

    for target in TARGETS.values():
        for name in GENERATED:
            assert filecmp.cmp(tmp_path / target / name, ROOT / target / name, shallow=False), target / name


class _Script:
    """A loopback HTTP server answering scripted (status, headers, body) and recording arrivals."""

    def __init__(self, answers: list[tuple[int, dict[str, str], dict]]) -> None:
        self.answers = answers
        self.arrivals: list[float] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                script.arrivals.append(time.monotonic())
                status, headers, body = script.answers[min(len(script.arrivals), len(script.answers)) - 1]
                raw = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Script:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


LOOKUP_OK = {"items": [{"hash": "ab" * 32, "cached": False, "tier": None}]}
BUSY = {"error": {"type": "overloaded", "message": "queue full", "index": None}}


def test_503_with_retry_after_is_retried_as_told() -> None:
    with _Script([(503, {"Retry-After": "1"}, BUSY), (200, {}, LOOKUP_OK)]) as server, Client(server.url) as client:
        started = time.monotonic()
        assert client.lookup(["ab" * 32])[0].cached is False
        waited = server.arrivals[1] - server.arrivals[0]
    assert len(server.arrivals) == 2
    assert 1.0 <= waited < 5.0, waited  # told 1 s: at least that, and no backoff on top of it
    assert time.monotonic() - started < 5.0


def test_bad_input_is_not_retried() -> None:
    bad = {"error": {"type": "invalid_hash", "message": "no", "index": 0}}
    with _Script([(400, {}, bad), (200, {}, LOOKUP_OK)]) as server, Client(server.url) as client, pytest.raises(
        ServerError
    ) as info:
        client.lookup(["ab" * 32])
    assert (info.value.status, info.value.type, info.value.index) == (400, "invalid_hash", 0)
    assert len(server.arrivals) == 1


def test_retries_stop_after_the_policy_and_raise_the_last_error() -> None:
    policy = RetryPolicy(max_retries=2, backoff=Backoff(base=0.01, cap=0.02))
    answers = [(504, {}, {"error": {"type": "timeout", "message": "slow", "index": None}})]
    with _Script(answers) as server, Client(server.url, retry=policy) as client, pytest.raises(ServerError) as info:
        client.lookup(["ab" * 32])
    assert info.value.type == "timeout" and len(server.arrivals) == 3


def test_unreachable_replica_fails_over_without_waiting() -> None:
    with _Script([(200, {}, LOOKUP_OK)]) as server:
        dead = f"http://127.0.0.1:{free_port()}"
        # Find a hash whose first choice is the dead replica.
        h = next(f"{i:064x}" for i in range(1000) if rank_replicas(f"{i:064x}", [dead, server.url])[0] == dead)
        # Any retry sleep would be >= 3 s (half of a 6 s backoff step), so < 2.5 s proves there was none.
        slow = RetryPolicy(backoff=Backoff(base=6.0, cap=6.0))
        with Client([dead, server.url], retry=slow) as client:
            started = time.monotonic()
            assert client.lookup([h])[0].hash == "ab" * 32  # the scripted answer
            assert time.monotonic() - started < 2.5
    assert len(server.arrivals) == 1


def test_backoff_grows_with_jitter_and_caps() -> None:
    b = Backoff(base=0.1, cap=1.0)
    delays = [b.delay(n) for n in range(1, 8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.5 <= d <= 1.0 for d in delays[4:])


def test_rendezvous_moves_only_the_keys_of_a_removed_replica() -> None:
    replicas = [f"http://r{i}:8000" for i in range(4)]
    keys = [f"{i:064x}" for i in range(400)]
    before = {k: rank_replicas(k, replicas)[0] for k in keys}
    after = {k: rank_replicas(k, replicas[:3])[0] for k in keys}
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == replicas[3]}
    assert 60 < sum(v == replicas[0] for v in before.values()) < 140  # roughly balanced


# -- the image-aware prefix key ------------------------------------------------------------------

A, B = "ab" * 32, "cd" * 32
VOCAB = 1000
PROMPT = [1, 2, 7, 7, 7, 7, 3, 7, 7, 4]  # 7: the placeholder; two images of 4 and 2 tokens


def test_same_prompt_and_images_give_the_same_ids() -> None:
    ids = image_aware_ids(PROMPT, 7, [(A, 4), (B, 2)], lo=VOCAB, hi=2**31)
    assert ids == image_aware_ids(PROMPT, 7, [(A, 4), (B, 2)], lo=VOCAB, hi=2**31)
    assert [ids[i] for i in (0, 1, 6, 9)] == [1, 2, 3, 4]
    assert all(VOCAB <= ids[i] < 2**31 for i in (2, 3, 4, 5, 7, 8))
    assert len(set(ids[2:6])) == 4, "positions inside a span get distinct pads"


def test_a_different_image_changes_exactly_its_span() -> None:
    one = image_aware_ids(PROMPT, 7, [(A, 4), (B, 2)], lo=VOCAB, hi=2**31)
    other = image_aware_ids(PROMPT, 7, [(A, 4), ("ef" * 32, 2)], lo=VOCAB, hi=2**31)
    assert [i for i in range(len(PROMPT)) if one[i] != other[i]] == [7, 8]


def test_pads_are_stable_across_processes() -> None:
    code = (
        "from encode_client import image_aware_ids;"
        f"print(image_aware_ids({PROMPT}, 7, [({A!r}, 4), ({B!r}, 2)], lo={VOCAB}, hi=2**31))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == image_aware_ids(PROMPT, 7, [(A, 4), (B, 2)], lo=VOCAB, hi=2**31)
    # Pinned: a change of derivation is a change of key space and must be deliberate.
    assert image_aware_ids([7], 7, [(A, 1)], lo=0, hi=2**31) == [_pinned()]


def _pinned() -> int:
    from blake3 import blake3

    context = encode_client.prefix_key.CONTEXT
    word = int.from_bytes(blake3(bytes.fromhex(A), derive_key_context=context).digest(8), "little")
    return word % 2**31


@pytest.mark.parametrize(
    ("images", "match"),
    [
        ([(A, 4)], "after the last image"),
        ([(A, 4), (B, 2), (A, 1)], "only 2 placeholder runs"),
        ([(A, 5), (B, 1)], "run at position 2 has 4"),
        ([(A, 4), ("xyz", 2)], "64 lowercase hex"),
        ([(A, 0), (B, 2)], "positive"),
    ],
)
def test_mismatched_images_and_placeholders_are_clear_errors(images: list, match: str) -> None:
    with pytest.raises(PrefixKeyError, match=match):
        image_aware_ids(PROMPT, 7, images, lo=VOCAB, hi=2**31)


def test_pad_range_is_validated() -> None:
    with pytest.raises(PrefixKeyError, match="pad range"):
        image_aware_ids(PROMPT, 7, [(A, 4), (B, 2)], lo=5, hi=5)
