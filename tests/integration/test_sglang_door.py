"""SGLang's front door (``--sglang``) on a real server over real HTTP, its embeddings read from real ZMQ
PULL sockets as SGLang's receiver binds them (no SGLang here: tests/sglang runs its own receiver).

Both backends (``zmq_to_tokenizer``: the port in ``/encode``; ``zmq_to_scheduler``: every rank
registered, before or after ``/encode``), SGLang's error frame and body for a bad image and a wrong
``content_hash`` (other requests untouched), a repeat served from the cache, and the rows and grids
SGLang rebuilds equal to ``/v1/encode``'s."""

from __future__ import annotations

import base64
import hashlib
import io
import pickle
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
import torch
import zmq

from tests.images import image_bytes
from tests.server import ServerProcess, run_server_to_exit, start_server
from tests.tiny_models import make_clip
from tests.videos import make_video

pytestmark = pytest.mark.integration

RECEIVER = ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData")
MODALITY = ("sglang.srt.multimodal.modality", "Modality")
TORCH = {"LongTensor", "FloatTensor", "float32", "bfloat16", "float16"}
MODALITIES = {1: "IMAGE", 2: "VIDEO", 3: "AUDIO"}


class EmbeddingData:
    """What SGLang's receiver unpickles frame 0 into (a stand-in: attributes only, no ``__init__`` run)."""

    req_id: str
    num_parts: int
    part_idx: int
    grid_dim: Any
    modality: str
    dtype: Any
    shape: list[int]
    error_msg: str | None
    error_code: int | None


class _Frames(pickle.Unpickler):
    """SGLang's allow-list for what these messages may name; its classes mapped to stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == RECEIVER:
            return EmbeddingData
        if (module, name) == MODALITY:
            return MODALITIES.__getitem__
        if module == "torch" and name in TORCH:
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name})")


def load(frames: list[bytes]) -> tuple[EmbeddingData, torch.Tensor | None]:
    obj = _Frames(io.BytesIO(frames[0])).load()
    assert isinstance(obj, EmbeddingData)
    if obj.error_msg is not None:
        assert len(frames) == 1
        return obj, None
    assert len(frames) == 2
    return obj, torch.frombuffer(bytearray(frames[1]), dtype=obj.dtype).reshape(obj.shape)


def data_uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


@dataclass
class Prefill:
    """PULL sockets bound as SGLang's tokenizer or scheduler ranks bind them."""

    context: zmq.Context[Any]

    def socket(self) -> tuple[zmq.Socket[Any], int]:
        sock = self.context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        return sock, sock.bind_to_random_port("tcp://127.0.0.1")


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    context: zmq.Context[Any] = zmq.Context()
    yield Prefill(context)
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sglang-files")
    (root / "cat.png").write_bytes(image_bytes(seed=41))
    return root


@pytest.fixture(scope="module")
def server(server_logs: Path, files: Path) -> Iterator[ServerProcess]:
    proc = start_server("--sglang", "--sglang-fetch-private", "--sglang-file-dir", str(files), "--max-wait-ms", "20",
                        "--request-timeout", "20", log_dir=server_logs)
    yield proc
    assert proc.stop() == 0, proc.log()


def encode(server: ServerProcess, req_id: str, items: list[Any], *, port: int | None, modality: str = "IMAGE",
           num_parts: int = 1, part_idx: int = 0) -> httpx.Response:
    body = {"req_id": req_id, "mm_items": items, "modality": modality, "num_parts": num_parts, "part_idx": part_idx,
            "prefill_host": "127.0.0.1", "embedding_port": port, "time_stats_json": None}
    return httpx.post(f"{server.url}/encode", json=body, timeout=60)


def register(server: ServerProcess, req_id: str, port: int, count: int) -> httpx.Response:
    body = {"req_id": req_id, "receive_url": f"127.0.0.1:{port}", "receive_count": count, "modality": "IMAGE"}
    return httpx.post(f"{server.url}/scheduler_receive_url", json=body, timeout=30)


def v1_rows(server: ServerProcess, datas: list[bytes], modality: str = "image") -> tuple[np.ndarray, list[Any]]:
    """The same items through /v1/encode: their rows, concatenated, and their meta."""
    items = [{"data": base64.b64encode(d).decode(), "modality": modality} for d in datas]
    answer = httpx.post(f"{server.url}/v1/encode", json={"items": items}, timeout=60).json()["items"]
    dtype = {"float32": np.float32, "float16": np.float16}[answer[0]["dtype"]]
    rows = [np.frombuffer(base64.b64decode(i["embedding"]), dtype=dtype).reshape(i["shape"]) for i in answer]
    return np.concatenate(rows), [i["meta"] for i in answer]


def metric(server: ServerProcess, line_start: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_zmq_to_tokenizer_gets_the_parts_rows_and_grids_as_v1_encode_gives_them(
    server: ServerProcess, prefill: Prefill, files: Path,
) -> None:
    a, b = image_bytes(seed=1, width=64, height=48), image_bytes("JPEG", width=96, height=40, seed=2)
    sock, port = prefill.socket()
    try:
        items = [data_uri(a), {"url": data_uri(b, "image/jpeg"), "detail": "auto",
                               "content_hash": "sha256:" + hashlib.sha256(b).hexdigest()}]
        answer = encode(server, "r1_local_part_0", items, port=port)
        assert (answer.status_code, answer.json()) == (200, None)
        obj, rows = load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    assert (obj.req_id, obj.num_parts, obj.part_idx, obj.modality) == ("r1_local_part_0", 1, 0, "IMAGE")
    expected, metas = v1_rows(server, [a, b])
    assert rows is not None and np.array_equal(rows.float().numpy(), expected.astype(np.float32))
    assert obj.grid_dim.dtype == torch.int64 and obj.grid_dim.tolist() == [m["image_grid_thw"] for m in metas]


def test_zmq_to_scheduler_pushes_to_each_rank_registered_before_or_after_encode(
    server: ServerProcess, prefill: Prefill,
) -> None:
    image = image_bytes(seed=3)
    (early, early_port), (late, late_port) = prefill.socket(), prefill.socket()
    try:
        assert register(server, "r2_local_part_1", early_port, 2).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(encode, server, "r2_local_part_1", [data_uri(image)], port=None, num_parts=2,
                                  part_idx=1)
            first, _ = load(early.recv_multipart())  # the registered rank has it before the other registers
            assert not pending.done()
            assert register(server, "r2_local_part_1", late_port, 2).status_code == 200
            assert (pending.result().status_code, pending.result().json()) == (200, None)
        second, rows = load(late.recv_multipart())
    finally:
        early.close(linger=0)
        late.close(linger=0)
    assert first.req_id == second.req_id == "r2_local_part_1" and (first.num_parts, first.part_idx) == (2, 1)
    expected, _ = v1_rows(server, [image])
    assert rows is not None and np.array_equal(rows.float().numpy(), expected.astype(np.float32))


def test_a_rank_registering_after_the_encode_started_still_gets_the_part(server: ServerProcess, prefill: Prefill
                                                                           ) -> None:
    sock, port = prefill.socket()
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(encode, server, "r3_local_part_0", [data_uri(image_bytes(seed=4))], port=None)
            time.sleep(0.5)
            assert register(server, "r3_local_part_0", port, 1).status_code == 200
            assert pending.result().status_code == 200
        obj, rows = load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    assert obj.req_id == "r3_local_part_0" and rows is not None and rows.shape[0] > 0


def test_a_bad_image_is_sglangs_400_with_an_error_frame_and_other_requests_go_on(
    server: ServerProcess, prefill: Prefill,
) -> None:
    (bad_sock, bad_port), (good_sock, good_port) = prefill.socket(), prefill.socket()
    try:
        with ThreadPoolExecutor(2) as pool:
            bad = pool.submit(encode, server, "bad_local_part_0", [data_uri(b"not an image at all")], port=bad_port)
            good = pool.submit(encode, server, "good_local_part_0", [data_uri(image_bytes(seed=5))], port=good_port)
            assert good.result().status_code == 200
            answer = bad.result()
        error, rows = load(bad_sock.recv_multipart())
        ok, good_rows = load(good_sock.recv_multipart())
    finally:
        bad_sock.close(linger=0)
        good_sock.close(linger=0)
    assert answer.status_code == 400
    body = answer.json()
    assert body["status"] == "error" and body["req_id"] == "bad_local_part_0" and body["type"] == "invalid_image"
    assert rows is None and error.error_msg == body["message"] and error.error_code == 400
    assert type(error.error_code) is int
    assert ok.error_msg is None and good_rows is not None


def test_a_wrong_content_hash_is_refused_before_anything_is_encoded(server: ServerProcess, prefill: Prefill) -> None:
    sock, port = prefill.socket()
    image = image_bytes(seed=6)
    try:
        item = {"url": data_uri(image), "content_hash": "sha256:" + hashlib.sha256(b"other").hexdigest()}
        answer = encode(server, "hash_local_part_0", [item], port=port)
        error, _ = load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    assert answer.status_code == 400 and answer.json()["type"] == "hash_mismatch"
    assert "content hash mismatch" in answer.json()["message"] and error.error_code == 400


def test_a_repeat_is_a_cache_hit(server: ServerProcess, prefill: Prefill) -> None:
    image = image_bytes(seed=7)
    sock, port = prefill.socket()
    try:
        assert encode(server, "rep_local_part_0", [data_uri(image)], port=port).status_code == 200
        _, first = load(sock.recv_multipart())
        hits = metric(server, 'encode_server_items_total{source="local",status="hit"}')
        assert encode(server, "rep2_local_part_0", [data_uri(image)], port=port).status_code == 200
        _, again = load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    assert metric(server, 'encode_server_items_total{source="local",status="hit"}') == hits + 1
    assert first is not None and again is not None and torch.equal(first, again)
    assert metric(server, 'encode_server_requests_total{code="200",route="/encode"}') >= 2


def test_a_video_part_carries_its_grid_and_seconds_per_temporal_group(server: ServerProcess, prefill: Prefill
                                                                      ) -> None:
    video = make_video(10, 4.0, 64, 96)
    sock, port = prefill.socket()
    try:
        answer = encode(server, "vid_local_part_0", [data_uri(video, "video/mp4")], port=port, modality="VIDEO")
        assert answer.status_code == 200, answer.text
        obj, rows = load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    expected, metas = v1_rows(server, [video], "video")
    assert obj.modality == "VIDEO" and obj.grid_dim.tolist() == [metas[0]["video_grid_thw"]]
    assert rows is not None and np.array_equal(rows.float().numpy(), expected.astype(np.float32))
    seconds = obj.second_per_grid_ts  # type: ignore[attr-defined]
    assert seconds.dtype == torch.float32 and seconds.tolist() == pytest.approx([metas[0]["second_per_grid_ts"]])


class _Images(BaseHTTPRequestHandler):
    image = image_bytes(seed=8)

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        self.send_response(200 if self.path == "/cat.png" else 404)
        self.send_header("Content-Length", str(len(self.image)))
        self.end_headers()
        self.wfile.write(self.image)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_site() -> Iterator[str]:
    site = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=site.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{site.server_address[1]}"
    site.shutdown()
    site.server_close()


def test_urls_and_paths_are_read_where_the_flags_allow(server: ServerProcess, prefill: Prefill, image_site: str,
                                                       files: Path) -> None:
    sock, port = prefill.socket()
    try:
        items = [f"{image_site}/redirect", str(files / "cat.png"), f"file://{files}/cat.png"]
        assert encode(server, "url_local_part_0", items, port=port).status_code == 200
        _, rows = load(sock.recv_multipart())
        outside = encode(server, "path_local_part_0", ["/etc/hostname.png"], port=port)
        load(sock.recv_multipart())
        missing = encode(server, "404_local_part_0", [f"{image_site}/nothing.png"], port=port)
        load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    expected, _ = v1_rows(server, [_Images.image, image_bytes(seed=41), image_bytes(seed=41)])
    assert rows is not None and np.array_equal(rows.float().numpy(), expected.astype(np.float32))
    assert (outside.status_code, outside.json()["type"]) == (400, "url_refused")
    assert (missing.status_code, missing.json()["type"]) == (400, "fetch_failed")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"mm_items": ["x"], "modality": "IMAGE", "num_parts": 1, "part_idx": 0}, "missing or invalid req_id"),
        ({"req_id": "r", "mm_items": [], "modality": "IMAGE", "num_parts": 1, "part_idx": 0}, "missing or empty"),
        ({"req_id": "r", "mm_items": ["x"], "modality": "TEXT", "num_parts": 1, "part_idx": 0}, "unsupported modality"),
        ({"req_id": "r", "mm_items": ["x"], "modality": "IMAGE", "num_parts": 1, "part_idx": 1}, "part_idx must be"),
    ],
)
def test_a_malformed_encode_is_sglangs_400(server: ServerProcess, body: dict[str, Any], message: str) -> None:
    answer = httpx.post(f"{server.url}/encode", json=body, timeout=30)
    assert answer.status_code == 400 and answer.json()["status"] == "error" and message in answer.json()["message"]


def test_a_rank_that_changes_receive_count_is_refused(server: ServerProcess) -> None:
    assert register(server, "rc_local_part_0", 20001, 2).status_code == 200
    answer = register(server, "rc_local_part_0", 20002, 3)
    assert answer.status_code == 400 and "Inconsistent receive_count" in answer.json()["message"]


def test_health_answers_200_for_sglangs_bootstrap(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


# -- the same door over gRPC (SGLang's --grpc-mode: sglang.grpc.encoder.SglangEncoder) -----------------


@pytest.fixture(scope="module")
def sglang_stub(server: ServerProcess) -> Iterator[Any]:
    import grpc

    from encode_server.api.proto.sglang_encoder import sglang_encoder_pb2_grpc

    channel = grpc.insecure_channel(server.grpc_target)
    yield sglang_encoder_pb2_grpc.SglangEncoderStub(channel)
    channel.close()


def test_grpc_encode_pushes_to_the_listed_port_or_to_the_registered_ranks(
    server: ServerProcess, prefill: Prefill, sglang_stub: Any,
) -> None:
    from encode_server.api.proto.sglang_encoder import sglang_encoder_pb2 as pb

    image = image_bytes(seed=9)
    (tok, tok_port), (rank, rank_port) = prefill.socket(), prefill.socket()
    try:
        sglang_stub.Encode(pb.EncodeRequest(mm_items=[data_uri(image)], req_id="g1_local_part_0", num_parts=1,
                                            part_idx=0, prefill_host="127.0.0.1", embedding_port=[tok_port]),
                           timeout=60)
        by_port, rows = load(tok.recv_multipart())
        sglang_stub.SchedulerReceiveUrl(pb.SchedulerReceiveUrlRequest(
            req_id="g2_local_part_0", receive_url=f"127.0.0.1:{rank_port}", receive_count=1), timeout=30)
        sglang_stub.Encode(pb.EncodeRequest(mm_items=[data_uri(image)], req_id="g2_local_part_0", num_parts=1,
                                            part_idx=0, prefill_host="127.0.0.1"), timeout=60)
        by_rank, again = load(rank.recv_multipart())
    finally:
        tok.close(linger=0)
        rank.close(linger=0)
    expected, _ = v1_rows(server, [image])
    assert (by_port.req_id, by_rank.req_id) == ("g1_local_part_0", "g2_local_part_0")
    assert rows is not None and again is not None and torch.equal(rows, again)
    assert np.array_equal(rows.float().numpy(), expected.astype(np.float32))
    assert metric(server, 'encode_server_requests_total{code="200",route="grpc:SglangEncoder/Encode"}') >= 2


def test_grpc_a_bad_image_is_invalid_argument_with_an_error_frame(
    server: ServerProcess, prefill: Prefill, sglang_stub: Any,
) -> None:
    import grpc

    from encode_server.api.proto.sglang_encoder import sglang_encoder_pb2 as pb

    sock, port = prefill.socket()
    try:
        with pytest.raises(grpc.RpcError) as failed:
            sglang_stub.Encode(pb.EncodeRequest(mm_items=[data_uri(b"junk")], req_id="g3_local_part_0", num_parts=1,
                                                part_idx=0, prefill_host="127.0.0.1", embedding_port=[port]),
                               timeout=60)
        error, _ = load(sock.recv_multipart())
    finally:
        sock.close(linger=0)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.error_code == 400 and error.error_msg == failed.value.details()
    with pytest.raises(grpc.RpcError) as send:
        sglang_stub.Send(pb.SendRequest(req_id="g3_local_part_0"), timeout=10)
    assert send.value.code() == grpc.StatusCode.UNIMPLEMENTED


class _Bootstrap(BaseHTTPRequestHandler):
    """SGLang's EncoderBootstrapServer, as an encoder sees it: register, unregister."""

    calls: ClassVar[list[tuple[str, str, dict[str, Any]]]] = []

    def _record(self) -> None:
        import json

        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        type(self).calls.append((self.command, self.path, body))
        self.send_response(200)
        self.send_header("Content-Length", "4")
        self.end_headers()
        self.wfile.write(b"null")

    do_POST = do_DELETE = _record

    def log_message(self, *args: object) -> None:
        pass


def test_the_server_registers_with_sglangs_bootstrap_once_ready_and_unregisters_on_shutdown(server_logs: Path
                                                                                            ) -> None:
    bootstrap = ThreadingHTTPServer(("127.0.0.1", 0), _Bootstrap)
    threading.Thread(target=bootstrap.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{bootstrap.server_address[1]}"
    try:
        proc = start_server("--sglang", "--sglang-register-urls", url, log_dir=server_logs)
        deadline = time.monotonic() + 20
        while not _Bootstrap.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _Bootstrap.calls == [("POST", "/register_encoder_url", {"url": proc.url})]
        assert proc.stop() == 0, proc.log()
        assert _Bootstrap.calls[1:] == [("DELETE", "/unregister_encoder_url", {"url": proc.url})]
    finally:
        bootstrap.shutdown()
        bootstrap.server_close()


def test_a_family_sglang_does_not_take_stops_a_sglang_start(tmp_path: Path) -> None:
    code, log = run_server_to_exit("--sglang", "--model", str(make_clip(tmp_path / "clip")))
    assert code == 1, log
    assert "not a family SGLang's language-only prefill takes" in log and "qwen2_vl" in log
