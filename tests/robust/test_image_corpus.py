"""Every file of a generated adversarial corpus gets the embedding of what it depicts (the
reference decode, as a plain PNG) or a documented 4xx naming it; never a 5xx; the server's peak
memory stays bounded; /v1/tokens agrees with /v1/encode, EXIF rotation included."""

from __future__ import annotations

import httpx
import pytest

from tests.calls import b64, server_errors
from tests.robust.conftest import rss_kib
from tests.robust.corpus import corpus, reference_png
from tests.server import ServerProcess

pytestmark = pytest.mark.integration

MAX_PIXELS = 4096 * 4096  # conftest.ROBUST_ARGS
REFUSALS = {(400, "invalid_image"), (400, "unsupported_image"), (413, "image_too_large")}
PEAK_GROWTH_MIB = 768
EXTREME_ASPECT = {"png-1x10000", "png-10000x1"}

CORPUS = corpus()


def post(server: ServerProcess, data: bytes, route: str = "/v1/encode") -> httpx.Response:
    return httpx.post(server.url + route, json={"items": [{"data": b64(data)}]}, timeout=60)


def test_corpus_gets_correct_embeddings_or_documented_4xx_with_bounded_memory(robust_server: ServerProcess) -> None:
    pid = robust_server.proc.pid
    assert post(robust_server, CORPUS["png-valid"]).status_code == 200  # warm: first batch allocations
    peak_before = rss_kib(pid, "VmHWM")
    outcomes: dict[str, str] = {}
    for name, data in CORPUS.items():
        r = post(robust_server, data)
        assert r.status_code < 500, (name, r.status_code, r.text)
        expected = reference_png(data, MAX_PIXELS)
        if expected is None:
            assert r.status_code != 200, f"{name}: must be refused, got an embedding"
            error = r.json()["error"]
            assert (r.status_code, error["type"]) in REFUSALS, (name, r.text)
            assert error["index"] == 0, name
            outcomes[name] = error["type"]
            continue
        if name in EXTREME_ASPECT and r.status_code == 400:
            # The processor's documented limit (aspect ratio below 200): refused, and counted alike.
            assert r.json()["error"]["type"] == "unsupported_image" and "aspect ratio" in r.text, r.text
            tokens = post(robust_server, data, "/v1/tokens")
            assert (tokens.status_code, tokens.json()["error"]["type"]) == (400, "unsupported_image"), tokens.text
            outcomes[name] = "unsupported_image"
            continue
        assert r.status_code == 200, (name, r.text)
        got = r.json()["items"][0]
        want = post(robust_server, expected).json()["items"][0]
        assert (got["shape"], got["meta"]) == (want["shape"], want["meta"]), name
        assert got["embedding"] == want["embedding"], f"{name}: not the embedding of what the file depicts"
        outcomes[name] = "embedding"
        tokens = post(robust_server, data, "/v1/tokens")
        assert tokens.status_code == 200, (name, tokens.text)
        assert tokens.json()["items"][0]["num_tokens"] == got["num_tokens"], name
    growth_mib = (rss_kib(pid, "VmHWM") - peak_before) / 1024
    assert growth_mib < PEAK_GROWTH_MIB, f"peak RSS grew {growth_mib:.0f} MiB over the corpus"
    # The oddities that must decode did, and the bombs were refused from their headers.
    for name in ("jpeg-cmyk", "jpeg-ycck", "png-16bit-gray", "png-palette-transparency", "png-la", "gif-animated",
                 "webp-animated", "png-1x1", "jpeg-zip-polyglot",
                 "jpeg-exif-orientation-6"):
        assert outcomes[name] == "embedding", (name, outcomes[name])
    for name in ("png-bomb-60k", "gif-bomb-50k", "tiff-bomb-50k", "webp-bomb-16k", "png-huge-header-2^31"):
        assert outcomes[name] == "image_too_large", (name, outcomes[name])
    for name in ("empty", "text", "zip", "png-zero-width", "png-truncated-10"):
        assert outcomes[name] == "invalid_image", (name, outcomes[name])
    assert server_errors(robust_server) == 0
    print({k: v for k, v in sorted(outcomes.items())})


def test_exif_rotation_is_applied_and_tokens_agree(robust_server: ServerProcess) -> None:
    for orientation, swapped in ((3, False), (6, True), (8, True)):
        data = CORPUS[f"jpeg-exif-orientation-{orientation}"]
        tokens = post(robust_server, data, "/v1/tokens").json()["items"][0]
        assert (tokens["width"], tokens["height"]) == ((32, 48) if swapped else (48, 32)), orientation
        encoded = post(robust_server, data).json()["items"][0]
        assert tokens["num_tokens"] == encoded["num_tokens"]
        assert tokens["meta"] == encoded["meta"]


def test_first_frame_of_animations_is_the_one_encoded(robust_server: ServerProcess) -> None:
    from io import BytesIO

    from PIL import Image

    for name in ("gif-animated", "webp-animated"):
        image = Image.open(BytesIO(CORPUS[name]))
        assert getattr(image, "n_frames", 1) == 3, name
        frames = []
        for i in range(3):
            image.seek(i)
            buf = BytesIO()
            image.convert("RGB").save(buf, "PNG")
            frames.append(post(robust_server, buf.getvalue()).json()["items"][0]["embedding"])
        got = post(robust_server, CORPUS[name]).json()["items"][0]["embedding"]
        assert got == frames[0] and got not in frames[1:], name
