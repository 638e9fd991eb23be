"""A server that cannot start says why in one line, exits non-zero, and never claims to run.

Real server processes: one holds the ports, a second one is started on them. Before these fixes a
second server on a taken gRPC port started and took part of the first one's connections
(grpc-core's ``SO_REUSEPORT``), an HTTP clash ended in ``Task exception was never retrieved``
after gRPC had said it was listening, and a missing ``--model`` directory printed a traceback
and then uvicorn's ``running on``.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.images import image_bytes
from tests.server import ServerProcess, free_port, run_server_to_exit, start_server

NOISE = ("Traceback", "Task exception was never retrieved", "listening", "running on", "SystemExit")


@pytest.fixture(scope="module")
def holder(server_logs: Path) -> Iterator[ServerProcess]:
    """The server that holds an HTTP and a gRPC port."""
    server = start_server(log_dir=server_logs)
    yield server
    assert server.stop() == 0, server.log()


def problems(output: str) -> list[str]:
    """The lines that report a problem (WARNING or worse, or anything unformatted on stderr)."""
    lines = [line for line in output.splitlines() if line.strip()]
    return [line for line in lines if not re.match(r"^\S+ \S+ (INFO|DEBUG) ", line)]


def assert_one_reason(code: int | None, output: str, *words: str) -> None:
    assert code is not None, f"the server started anyway:\n{output}"
    assert code != 0, output
    reported = problems(output)
    assert len(reported) == 1, f"expected one line with the reason, got:\n{output}"
    assert all(word in reported[0] for word in words), reported[0]
    noise = [word for word in NOISE if word in output]
    assert noise == [], f"{noise} in:\n{output}"


def test_a_second_server_on_a_taken_grpc_port_fails_naming_it(holder: ServerProcess) -> None:
    code, output = run_server_to_exit("--grpc-port", str(holder.grpc_port))
    assert_one_reason(code, output, f"127.0.0.1:{holder.grpc_port}", "--grpc-port", "in use")
    # Every fresh channel still reaches the one server that holds the port.
    for _ in range(5):
        with grpc.insecure_channel(holder.grpc_target) as channel:
            assert pb_grpc.EncoderStub(channel).Model(pb.ModelRequest(), timeout=10).fingerprint


def test_a_second_server_on_a_taken_http_port_fails_naming_it(holder: ServerProcess) -> None:
    port = int(holder.url.rsplit(":", 1)[1])
    code, output = run_server_to_exit(port=port)
    assert_one_reason(code, output, f"127.0.0.1:{port}", "--port", "in use")


def test_http_and_grpc_on_one_port_fail_naming_it() -> None:
    port = free_port()
    code, output = run_server_to_exit("--grpc-port", str(port), port=port)
    assert_one_reason(code, output, f"127.0.0.1:{port}", "--grpc-port")


def test_a_missing_model_directory_fails_before_any_port_opens() -> None:
    code, output = run_server_to_exit("--model", "/nonexistent/dir")
    assert_one_reason(code, output, "/nonexistent/dir", "--model")


def test_a_model_that_fails_to_load_says_why_in_one_line_and_exits_1(tmp_path: Path) -> None:
    """A directory without config.json fails in the loader, after the doors opened: one line,
    no traceback, exit 1, and nothing said after it claims the server runs."""
    code, output = run_server_to_exit("--model", str(tmp_path))
    assert code == 1, output
    reported = problems(output)
    assert len(reported) == 1 and "model failed to load" in reported[0] and "config.json" in reported[0], output
    assert "Traceback" not in output
    after = output[output.index("model failed to load"):]
    assert "listening" not in after and "running on" not in after, output


def test_a_redis_url_without_a_scheme_fails_at_flag_parsing_listing_the_schemes() -> None:
    """Before: the flags passed, the ports opened, and the load failed 6 s later on redis-py's words."""
    code, output = run_server_to_exit("--redis-url", "localhost:6379")
    assert_one_reason(code, output, "--redis-url", "redis://", "rediss://", "unix://")
    assert "encode_server" not in output, "refused by the flags, before any logging (or port) is set up"


def test_a_redis_url_redis_py_refuses_fails_before_any_port_opens() -> None:
    code, output = run_server_to_exit("--redis-url", "redis://localhost:6379/0?socket_timeout=soon")
    assert_one_reason(code, output, "not started", "--redis-url", "socket_timeout")


def test_cuda_on_a_torch_without_it_fails_in_one_line_before_any_port_opens() -> None:
    """Before: the ports opened, then the load died with a traceback ending in torch's words."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch can use CUDA")
    code, output = run_server_to_exit("--device", "cuda")
    assert_one_reason(code, output, "not started", "--device cuda", "CUDA")
    assert len(output.strip().splitlines()) == 1, f"the reason alone, nothing before it:\n{output}"


def test_an_unreachable_redis_is_said_in_the_start_up_line_and_the_server_serves(server_logs: Path) -> None:
    """Before: ``shared tier: redis (...)`` read as all well, and the outage was logged seconds later."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    server = start_server("--redis-url", url, log_dir=server_logs)
    try:
        data = base64.b64encode(image_bytes("PNG", 20, 20)).decode()
        r = httpx.post(server.url + "/v1/encode", json={"items": [{"data": data}]}, timeout=30)
        assert r.status_code == 200 and r.json()["items"][0]["status"] == "encoded"
        log = server.log()
        said = [line for line in log.splitlines() if "shared tier: redis" in line]
        assert len(said) == 1, log
        assert " WARNING " in said[0] and f"{url}, unreachable: " in said[0], said[0]
        assert said[0].endswith("serving from the local tier until it returns"), said[0]
        assert "Redis unreachable" not in log, "the outage is said once, at start"
        assert "encode_server_redis_up 0.0" in httpx.get(server.url + "/metrics").text
    finally:
        assert server.stop() == 0, server.log()


def test_an_export_dir_that_cannot_be_made_fails_before_any_port_opens(tmp_path: Path) -> None:
    """Before: the ports opened, then ``model failed to load: [Errno 2] ...`` named the wrong culprit."""
    (tmp_path / "file").write_text("")
    code, output = run_server_to_exit("--export-dir", str(tmp_path / "file" / "under"))
    assert_one_reason(code, output, "not started", "--export-dir")
