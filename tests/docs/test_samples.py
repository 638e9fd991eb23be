"""The sample answers in README.md and docs/ are what ``builtin:tiny`` serves (on the CPU, as the
docs' first run does): every fingerprint shown, whole or cut short (``0b8e…``), and the token
counts of the README's ``/v1/tokens`` sample, read from a real server."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.docs.markdown import ROOT, doc_files
from tests.server import start_server

# "fingerprint": "<hex>" and a key's encode:v1:<hex>:..., whole or cut short with an ellipsis.
_FINGERPRINT = re.compile(r'"fingerprint": ?"([0-9a-f]+)…?"|:v1:([0-9a-f]+)…?:')


def test_the_fingerprint_and_token_samples_are_what_the_builtin_model_serves(tmp_path: Path) -> None:
    server = start_server(log_dir=tmp_path)
    try:
        served = httpx.get(server.url + "/v1/model", timeout=30).json()["fingerprint"]
        tokens = httpx.post(server.url + "/v1/tokens", json={"sizes": [[640, 480]]}, timeout=30).json()["items"][0]
    finally:
        assert server.stop() == 0, server.log()
    samples = [
        (doc.relative_to(ROOT).as_posix(), m.group(1) or m.group(2))
        for doc in doc_files() for m in _FINGERPRINT.finditer(doc.read_text())
    ]
    assert len(samples) >= 5, samples
    wrong = [(page, sample) for page, sample in samples if len(sample) < 4 or not served.startswith(sample)]
    assert wrong == [], f"builtin:tiny serves fingerprint {served}; these samples say otherwise: {wrong}"
    readme = (ROOT / "README.md").read_text()
    assert (tokens["num_tokens"], tokens["meta"]) == (234, {"image_grid_thw": [1, 26, 36]})
    assert '"num_tokens": 234,' in readme and '"meta": {"image_grid_thw": [1, 26, 36]}' in readme
