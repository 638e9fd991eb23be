"""SGLang 0.5.23's language-only prefill, its receiving side (``tests/sglang/prefill.py``), against two
real encode-servers (``--sglang``) on a tiny Qwen2.5-VL over real HTTP and ZMQ, with a real Redis.

Each request goes through SGLang's own dispatch (its split of the items over the encoders, one
``POST /encode`` per part), its receive (``zmq_to_tokenizer``: the tokenizer's socket; or
``zmq_to_scheduler``: two tensor-parallel ranks, each registering its socket with
``POST /scheduler_receive_url``), its allow-list unpickler and part collection, and Qwen-VL's
processor's ``get_validated_mm_data`` (the rows laid into the prompt's placeholders, their counts
checked). The rows SGLang ends with must equal encode-server's own ``/v1/encode`` rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang.conftest import data_uri, image_item, png
from tests.sglang.oracle import encode_rows, items_total, prompt_for
from tests.sglang.prefill import Failure, Prefill, modality_rows
from tests.videos import make_video


def _expected(url: str, datas: list[bytes], modality: str = "image") -> tuple[torch.Tensor, list[list[int]]]:
    rows, grids = [], []
    for data in datas:
        tensor, meta = encode_rows(url, data, modality)
        rows.append(tensor)
        grids.append(meta["image_grid_thw" if modality == "image" else "video_grid_thw"])
    return torch.cat(rows), grids


def _placeholders(output: Any, token_id: int) -> int:
    return sum(1 for t in output.input_ids if t == token_id)


def _check_images(prefill: Prefill, output: Any, url: str, datas: list[bytes]) -> None:
    """SGLang's rows are encode-server's, in order, and each placeholder got its item's rows."""
    expected, _ = _expected(url, datas)
    got = modality_rows(output)["image"]
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert len(output.mm_items) == len(datas)
    assert _placeholders(output, prefill.hf_config.image_token_id) == expected.shape[0]
    assert output.mrope_positions is not None and output.mrope_positions.shape[-1] == len(output.input_ids)


def test_one_image_through_zmq_to_tokenizer_lands_as_encode_servers_rows(replicas: list[Any], qwen_dir: Path,
                                                                         prefill_of: Any) -> None:
    prefill: Prefill = prefill_of(qwen_dir, [replicas[0].url])
    image = png(120, 90, seed=1)
    received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=1), images=[image_item(image)])
    _check_images(prefill, received.output, replicas[0].url, [image])


def test_several_images_in_one_request_keep_their_order(replicas: list[Any], qwen_dir: Path,
                                                         prefill_of: Any) -> None:
    prefill: Prefill = prefill_of(qwen_dir, [replicas[0].url])
    images = [png(64, 48, seed=2), png(200, 100, seed=3), png(56, 112, seed=4)]
    received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=3),
                               images=[image_item(images[0]), image_item(images[1], with_hash=False),
                                       image_item(images[2])])
    _check_images(prefill, received.output, replicas[0].url, images)


def test_two_encode_servers_each_take_a_part_of_one_request(replicas: list[Any], qwen_dir: Path,
                                                            prefill_of: Any) -> None:
    """SGLang splits 4 images 2 + 2 over its two encoders (two parts); it joins them in order."""
    prefill: Prefill = prefill_of(qwen_dir, [r.url for r in replicas])
    images = [png(60 + 8 * i, 70, seed=10 + i) for i in range(4)]
    before = [items_total(r.url, "encoded", "encoder") for r in replicas]
    obj_images = [image_item(d) for d in images]
    received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=4), images=obj_images)
    after = [items_total(r.url, "encoded", "encoder") for r in replicas]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2], "each encoder encodes its own part"
    _check_images(prefill, received.output, replicas[0].url, images)


def test_zmq_to_scheduler_delivers_to_both_tensor_parallel_ranks(replicas: list[Any], qwen_dir: Path,
                                                                 prefill_of: Any) -> None:
    """Two ranks, each with its own socket registered by ``/scheduler_receive_url`` (receive_count 2),
    two encoders splitting three images: every rank assembles the whole request."""
    prefill: Prefill = prefill_of(qwen_dir, [r.url for r in replicas], backend="zmq_to_scheduler", tp_size=2)
    images = [png(90, 60, seed=20), png(60, 90, seed=21), png(100, 100, seed=22)]
    received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=3),
                               images=[image_item(d) for d in images])
    assert len(received.outputs) == 2
    for output in received.outputs:
        _check_images(prefill, output, replicas[1].url, images)
    assert prefill.pending() == 0


def test_ranks_that_register_after_the_encode_still_get_the_part(replicas: list[Any], qwen_dir: Path,
                                                                  prefill_of: Any) -> None:
    """The scheduler may take the request after the encoder got its ``/encode``: the part is held
    until both ranks have registered (SGLang's own encoder waits up to 180 s)."""
    prefill: Prefill = prefill_of(qwen_dir, [replicas[0].url], backend="zmq_to_scheduler", tp_size=2)
    images = [png(72, 72, seed=24)]
    received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=1),
                               images=[image_item(d) for d in images], ranks_after=1.5)
    assert received.seconds >= 1.5
    for output in received.outputs:
        _check_images(prefill, output, replicas[0].url, images)


def test_items_by_http_url_are_fetched_and_their_content_hash_checked(replicas: list[Any], qwen_dir: Path,
                                                                     prefill_of: Any) -> None:
    """An item SGLang passes on as an ``http://`` URL (on loopback: ``--sglang-fetch-private``) is
    fetched; one whose ``content_hash`` is not its bytes' fails the request with a 400."""
    image = png(88, 66, seed=25)
    with _serving({"/cat.png": image}) as base:
        prefill: Prefill = prefill_of(qwen_dir, [replicas[0].url], backend="zmq_to_scheduler", tp_size=1)
        prompt = prompt_for(prefill.tokenizer, prefill.hf_config, images=1)
        sha = "sha256:" + hashlib.sha256(image).hexdigest()
        received = prefill.receive(prompt, images=[{"url": f"{base}/cat.png", "content_hash": sha}])
        _check_images(prefill, received.output, replicas[0].url, [image])
        wrong = "sha256:" + hashlib.sha256(b"another image").hexdigest()
        with pytest.raises(Failure) as failed:
            prefill.receive(prompt, images=[{"url": f"{base}/cat.png", "content_hash": wrong}])
        assert failed.value.code == 400, failed.value


@contextlib.contextmanager
def _serving(files: dict[str, bytes]) -> Iterator[str]:
    """A plain HTTP server on loopback serving ``files`` by path."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_video_lands_with_its_grid_and_seconds_per_group(replicas: list[Any], qwen_dir: Path,
                                                           prefill_of: Any) -> None:
    """A 2.5 s H.264 clip at 4 fps: its rows, ``video_grid_thw`` and ``second_per_grid_ts`` (which
    SGLang's rope index reads) are encode-server's."""
    prefill: Prefill = prefill_of(qwen_dir, [replicas[0].url])
    clip = make_video(10, 4.0, 84, 56, seed=3)
    image = png(70, 70, seed=23)
    received = prefill.receive(prompt_for(prefill.tokenizer, prefill.hf_config, images=1, videos=1),
                               images=[image_item(image)], videos=[data_uri(clip, "video/mp4")])
    output = received.output
    rows = modality_rows(output)
    expected_video, meta = encode_rows(replicas[0].url, clip, "video")
    assert torch.equal(rows["video"], expected_video)
    assert torch.equal(rows["image"], encode_rows(replicas[0].url, image)[0])
    assert _placeholders(output, prefill.hf_config.video_token_id) == expected_video.shape[0]
    # the rope positions SGLang computed with the grid and seconds the server sent equal those from
    # the server's /v1/encode meta
    from sglang.srt.layers.rotary_embedding import MRotaryEmbedding

    grid = torch.tensor([meta["video_grid_thw"]])
    image_grid = torch.tensor([encode_rows(replicas[0].url, image)[1]["image_grid_thw"]])
    positions, _ = MRotaryEmbedding.get_rope_index(
        spatial_merge_size=prefill.hf_config.vision_config.spatial_merge_size,
        image_token_id=prefill.hf_config.image_token_id, video_token_id=prefill.hf_config.video_token_id,
        vision_start_token_id=prefill.hf_config.vision_start_token_id, model_type="qwen2_5_vl",
        input_ids=torch.tensor(output.input_ids).unsqueeze(0), image_grid_thw=image_grid, video_grid_thw=grid,
        second_per_grid_ts=torch.tensor([meta["second_per_grid_ts"]]),
        tokens_per_second=prefill.hf_config.vision_config.tokens_per_second,
    )
    assert torch.equal(positions.squeeze(1), output.mrope_positions)


@pytest.mark.parametrize("backend", ["zmq_to_tokenizer", "zmq_to_scheduler"])
def test_a_bad_image_fails_its_request_at_once_and_disturbs_nothing_else(
    replicas: list[Any], qwen_dir: Path, prefill_of: Any, backend: str
) -> None:
    """An undecodable image: SGLang gives the request up at once (the error frame and the 400, not
    its receive timeout); the next request, on the same prefill and encoders, is served."""
    tp = 2 if backend == "zmq_to_scheduler" else 1
    prefill: Prefill = prefill_of(qwen_dir, [replicas[0].url], backend=backend, tp_size=tp)
    prompt = prompt_for(prefill.tokenizer, prefill.hf_config, images=2)
    started = time.monotonic()
    with pytest.raises(Failure) as failed:
        prefill.receive(prompt, images=[image_item(png(64, 64, seed=30)), data_uri(b"not an image at all")])
    assert time.monotonic() - started < prefill.timeout / 2, "SGLang waited for its timeout"
    if backend == "zmq_to_scheduler":  # the rank's abort carries the encoder's message and status
        assert failed.value.code == 400, failed.value
        assert "image" in (failed.value.message or "").lower(), failed.value
    else:  # the tokenizer refuses the request (no local fallback in language-only mode)
        assert failed.value.code == 503, failed.value
    assert prefill.pending() == 0
    good = [png(64, 64, seed=31), png(80, 40, seed=32)]
    received = prefill.receive(prompt, images=[image_item(d) for d in good])
    for output in received.outputs:
        _check_images(prefill, output, replicas[0].url, good)


def test_200_concurrent_requests_are_all_answered(replicas: list[Any], qwen_dir: Path, prefill_of: Any) -> None:
    """200 requests at once from one tokenizer (SGLang's own receive loop, concurrent in its event
    loop) over both encoders: every one gets its rows, none is dropped or hangs."""
    prefill: Prefill = prefill_of(qwen_dir, [r.url for r in replicas])
    prompt = prompt_for(prefill.tokenizer, prefill.hf_config, images=1)
    images = [png(32 + (i % 5) * 8, 32 + (i // 5) % 5 * 8, seed=1000 + i) for i in range(200)]

    async def one(data: bytes) -> Any:
        obj = prefill.request(prompt, images=[image_item(data)])
        return await prefill.tokenizer_side.recv_mm_data(request_obj=obj, mm_processor=prefill.mm_processor,
                                                         prompt=prompt, need_wait_for_mm_inputs=True)

    async def all_of_them() -> list[Any]:
        return await asyncio.gather(*(one(d) for d in images))

    before = sum(items_total(r.url, "encoded", "encoder") for r in replicas)
    started = time.monotonic()
    outputs = asyncio.run(all_of_them())
    elapsed = time.monotonic() - started
    missing = [i for i, out in enumerate(outputs) if out is None]
    assert not missing, f"{len(missing)} of 200 got no embedding (first: {missing[:5]}) in {elapsed:.1f} s"
    assert sum(items_total(r.url, "encoded", "encoder") for r in replicas) - before == 200
    for i in (0, 77, 199):  # a sample against /v1/encode; the rest by count
        assert torch.equal(modality_rows(outputs[i])["image"], encode_rows(replicas[0].url, images[i])[0])
    for out in outputs:
        assert _placeholders(out, prefill.hf_config.image_token_id) == out.mm_items[0].precomputed_embeddings.shape[0]


def test_a_repeat_on_the_other_replica_is_served_from_redis(replicas: list[Any], qwen_dir: Path,
                                                             prefill_of: Any) -> None:
    """An image one replica encoded for SGLang is, asked of the other, a Redis hit: no encode, the
    same rows."""
    first, other = replicas
    image = png(150, 110, seed=40)
    prompt: str
    prefill: Prefill = prefill_of(qwen_dir, [first.url])
    prompt = prompt_for(prefill.tokenizer, prefill.hf_config, images=1)
    rows_first = modality_rows(prefill.receive(prompt, images=[image_item(image)]).output)["image"]
    prefill.close()
    prefill_other: Prefill = prefill_of(qwen_dir, [other.url])
    hits, encoded = items_total(other.url, "hit", "redis"), items_total(other.url, "encoded", "encoder")
    rows_other = modality_rows(prefill_other.receive(prompt, images=[image_item(image)]).output)["image"]
    assert items_total(other.url, "hit", "redis") == hits + 1
    assert items_total(other.url, "encoded", "encoder") == encoded
    # the same bytes, not only equal values: SGLang's prefix cache keys a request by hashing this tensor
    assert rows_first.numpy().tobytes() == rows_other.numpy().tobytes()
