"""SIGTERM drains: /ready turns 503 and new work is refused, in-flight requests finish, exit 0.
A second SIGTERM, or SIGINT (Ctrl-C), stops at once: what is in flight is answered 503
``not_ready`` on both doors (never a 500, never a traceback in the log), exit 0."""

from __future__ import annotations

import base64
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.calls import metric
from tests.images import slow_png
from tests.server import start_server


def test_sigterm_finishes_in_flight_requests_then_exits_0(server_logs: Path) -> None:
    # Each image has 16 M pixels to decode and resize, so the requests below are still in flight
    # when all four are admitted and SIGTERM goes out.
    server = start_server("--drain-seconds", "20", log_dir=server_logs)
    try:
        images = [slow_png(seed=300 + i) for i in range(4)]
        results: list[httpx.Response] = []
        answered_at: list[float] = []

        def send(data: bytes) -> None:
            body = {"items": [{"data": base64.b64encode(data).decode()}]}
            results.append(httpx.post(server.url + "/v1/encode", json=body, timeout=30))
            answered_at.append(time.monotonic())

        threads = [threading.Thread(target=send, args=(d,)) for d in images]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while metric(server, "encode_server_queue_depth") < len(images):
            assert time.monotonic() < deadline, "requests never reached the queue"
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()

        deadline = time.monotonic() + 5
        while httpx.get(server.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "/ready did not turn 503"
            time.sleep(0.02)
        refused = httpx.post(server.url + "/v1/encode", json={"items": [{"hash": "ab" * 32}]})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "not_ready"
        assert int(refused.headers["Retry-After"]) >= 1

        for t in threads:
            t.join(30)
        assert [r.status_code for r in results] == [200] * len(images)
        assert min(answered_at) > signalled_at, "a request was answered before SIGTERM: none was in flight"
        assert all(r.json()["items"][0]["status"] == "encoded" for r in results)
        assert server.proc.wait(20) == 0, server.log()
        assert "drained; shutting down" in server.log()
    finally:
        server.stop()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def no_error_lines(log: str) -> list[str]:
    """The lines of a clean run's log that would alarm an operator grepping it for errors."""
    alarming = ("error", "traceback", "exception", "waiting for connections to close")
    return [line for line in log.splitlines() if any(word in line.lower() for word in alarming)]


@pytest.mark.parametrize("signals", [("SIGTERM", "SIGTERM"), ("SIGINT",)], ids=["second-sigterm", "sigint"])
def test_a_second_sigterm_or_sigint_stops_at_once_and_answers_what_is_in_flight_503(
    signals: tuple[str, ...], server_logs: Path
) -> None:
    # One preprocessing thread decodes the 16 M-pixel images one after the other, so the later
    # ones are still waiting when the signal comes; a drain (60 s) would have answered them 200.
    server = start_server("--drain-seconds", "60", "--preprocess-workers", "1", log_dir=server_logs)
    try:
        http_answers: list[httpx.Response] = []
        grpc_answers: list[grpc.RpcError | pb.EncodeResponse] = []

        def via_http(body: dict[str, object]) -> None:
            http_answers.append(httpx.post(server.url + "/v1/encode", json=body, timeout=60))

        # Every body is built, and the gRPC channel connected, before anything is sent, so that the
        # gRPC call joins the queue within milliseconds of the HTTP requests, while the first of
        # them is still decoding.
        bodies = [{"items": [{"data": base64.b64encode(slow_png(seed=310 + i)).decode()}]} for i in range(3)]
        request = pb.EncodeRequest(items=[pb.Item(data=slow_png(seed=320))])
        channel = grpc.insecure_channel(server.grpc_target)
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = pb_grpc.EncoderStub(channel)

        def via_grpc() -> None:
            try:
                grpc_answers.append(stub.Encode(request, timeout=60))
            except grpc.RpcError as exc:
                grpc_answers.append(exc)

        threads = [threading.Thread(target=via_http, args=(body,)) for body in bodies]
        for t in threads:
            t.start()
        wait_for(lambda: metric(server, "encode_server_queue_depth") >= 3, "the HTTP requests never reached the queue")
        threads.append(threading.Thread(target=via_grpc))  # behind them: in flight at the stop
        threads[-1].start()
        wait_for(lambda: metric(server, "encode_server_queue_depth") >= 4, "the gRPC call never reached the queue")

        for i, name in enumerate(signals):
            server.proc.send_signal(getattr(signal, name))
            if i + 1 < len(signals):  # the first SIGTERM drains; the next must find it draining
                wait_for(lambda: "SIGTERM: draining" in server.log(), "the first SIGTERM did not start a drain")
        for t in threads:
            t.join(60)
        assert server.proc.wait(30) == 0, server.log()

        log = server.log()
        why = "second SIGTERM" if len(signals) == 2 else "SIGINT"
        assert f"{why}: stopping now" in log, log
        statuses = [r.status_code for r in http_answers]
        assert len(statuses) == 3 and set(statuses) <= {200, 503}, statuses  # never a 500
        stopped = [r for r in http_answers if r.status_code == 503]
        assert stopped, f"every request finished: none was in flight at the stop ({statuses})"
        for r in stopped:
            assert r.json()["error"] == {"type": "not_ready", "message": "server is shutting down", "index": None}
            assert int(r.headers["Retry-After"]) >= 1
        (answer,) = grpc_answers
        assert isinstance(answer, grpc.RpcError), "the gRPC call finished before the stop"
        assert answer.code() == grpc.StatusCode.UNAVAILABLE, answer
        assert answer.details() == "not_ready: server is shutting down"
        assert dict(answer.trailing_metadata() or ())["error-type"] == "not_ready"
        assert no_error_lines(log) == [], log
    finally:
        server.stop()


def test_start_up_and_shutdown_lines_are_not_logged_under_an_error_name(server_logs: Path) -> None:
    server = start_server(log_dir=server_logs)
    assert server.stop() == 0
    log = server.log()
    assert "INFO uvicorn: Started server process" in log and "INFO uvicorn: Shutting down" in log, log
    assert no_error_lines(log) == [], log
