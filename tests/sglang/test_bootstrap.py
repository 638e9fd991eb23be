"""Self-registration against SGLang 0.5.23's own encoder bootstrap (``EncoderBootstrapServer``: what a
language-only prefill runs on ``--encoder-bootstrap-port``, with its health probes): an encode-server
started with ``--sglang-register-urls`` joins its list once ready, stays through the probes (``GET
/health``), serves a request SGLang sends to the encoders it lists, and leaves the list when it stops."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sglang.srt.disaggregation.encoder.receiver import EncoderBootstrapServer

from tests.server import free_port, start_server
from tests.sglang.conftest import SGLANG_FLAGS, image_item, png
from tests.sglang.oracle import encode_rows, prompt_for
from tests.sglang.prefill import Prefill, modality_rows

PROBE_S = 0.3  # SGLang probes every 10 s by default; evicts after 3 failed probes in a row


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def test_a_server_registers_stays_through_the_probes_serves_and_unregisters(qwen_dir: Path, logs: Path,
                                                                           prefill_of: Any) -> None:
    urls: list[str] = []
    port = free_port()
    bootstrap = EncoderBootstrapServer("127.0.0.1", port, urls=urls, health_check_interval=PROBE_S,
                                       health_check_timeout=2.0)
    try:
        _until(lambda: bootstrap._server is not None and bootstrap._server.started, 20, "SGLang's bootstrap up")
        server = start_server("--model", str(qwen_dir), "--grpc-port", "0", *SGLANG_FLAGS,
                              "--sglang-register-urls", f"http://127.0.0.1:{port}", log_dir=logs,
                              python=os.environ["ENCODE_SERVER_PYTHON"])
        try:
            _until(lambda: bootstrap.list_urls() == [server.url], 30, f"{server.url} registered: {urls}")
            dead = f"http://127.0.0.1:{free_port()}"  # the control: nothing answers its probes
            bootstrap.register(dead)
            _until(lambda: dead not in bootstrap.list_urls(), 20, "the probes evict an encoder that fails them")
            time.sleep(PROBE_S * 4)
            assert bootstrap.list_urls() == [server.url], "evicted by SGLang's health probes"
            prefill: Prefill = prefill_of(qwen_dir, urls)  # the bootstrap's own list, as SGLang shares it
            image = png(77, 55, seed=80)
            received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=1),
                                       images=[image_item(image)])
            assert torch.equal(modality_rows(received.output)["image"], encode_rows(server.url, image)[0])
        finally:
            server.stop()
        _until(lambda: bootstrap.list_urls() == [], 10, f"{server.url} unregistered on shutdown: {urls}")
    finally:
        bootstrap.close()
