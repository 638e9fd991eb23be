"""What SGLang's door reads for an ``mm_items`` entry, and what it refuses: private addresses unless
allowed (checked at the name and at the peer really reached), bodies past the upload limit, paths
outside ``--sglang-file-dir``, preprocessing it would not apply, and a ``content_hash`` that differs."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from encode_server.api.sglang_fetch import FetchPolicy, _a_path, _public, check_content_hash, resolve_item
from encode_server.api.sglang_push import Full, Registrations, endpoint_of
from encode_server.core.budget import ByteBudget
from encode_server.core.errors import BadInput, InvalidRequest, TooLarge

BODY = b"\x89PNG fake bytes" * 100


class _Site(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/trickle":  # a byte every 0.2 s: each read is quick, the whole never ends in time
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(25):  # 5 s at most, well past the client's 1 s
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                pass
            return
        if self.path.startswith("/hop"):
            hops = int(self.path[4:] or 0)
            self.send_response(302)
            self.send_header("Location", f"/hop{hops + 1}" if hops < 10 else "/img")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Site)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def fetch(entry: object, policy: FetchPolicy) -> bytes:
    return asyncio.run(resolve_item(entry, 0, policy, None))


OPEN = FetchPolicy(max_bytes=1 << 20, timeout=10, allow_private=True)
CLOSED = FetchPolicy(max_bytes=1 << 20, timeout=10)


def test_a_loopback_url_is_refused_unless_private_addresses_are_allowed(site: str) -> None:
    with pytest.raises(BadInput) as refused:
        fetch(f"{site}/img", CLOSED)
    assert refused.value.type == "url_refused" and "127.0.0.1" in refused.value.message
    assert fetch(f"{site}/img", OPEN) == BODY


@pytest.mark.parametrize("host", ["10.0.0.1", "169.254.169.254", "[::1]", "192.168.1.1", "0.0.0.0"])
def test_private_link_local_and_unspecified_addresses_are_refused_before_connecting(host: str) -> None:
    with pytest.raises(BadInput) as refused:
        fetch(f"http://{host}:9/x.png", CLOSED)
    assert refused.value.type == "url_refused"


def test_redirects_are_followed_a_few_times_only(site: str) -> None:
    assert fetch(f"{site}/hop8", OPEN) == BODY
    with pytest.raises(BadInput) as refused:
        fetch(f"{site}/hop0", OPEN)
    assert refused.value.type == "fetch_failed" and "redirects" in refused.value.message


def test_a_body_past_the_upload_limit_is_413(site: str) -> None:
    with pytest.raises(TooLarge):
        fetch(f"{site}/img", FetchPolicy(max_bytes=100, timeout=10, allow_private=True))


def test_fetched_bytes_are_charged_to_the_request_memory_budget(site: str) -> None:
    hold = ByteBudget(1 << 20).hold()
    asyncio.run(resolve_item(f"{site}/img", 0, OPEN, hold))
    assert hold.held >= len(BODY)


def test_a_path_is_read_only_inside_the_file_dir(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(BODY)
    inside = FetchPolicy(max_bytes=1 << 20, timeout=10, file_dir=str(tmp_path))
    assert fetch(str(tmp_path / "a.png"), inside) == BODY
    assert fetch(f"file://{tmp_path}/a.png", inside) == BODY
    for entry, policy in ((str(tmp_path / "a.png"), CLOSED), (str(tmp_path / ".." / "x.png"), inside),
                          ("/etc/passwd", inside)):
        with pytest.raises(BadInput) as refused:
            fetch(entry, policy)
        assert refused.value.type == "url_refused"


def test_data_uris_and_raw_base64_are_decoded() -> None:
    encoded = base64.b64encode(BODY).decode()
    assert fetch(f"data:image/png;base64,{encoded}", CLOSED) == BODY
    assert fetch(encoded, CLOSED) == BODY
    assert fetch({"url": encoded, "detail": "auto"}, CLOSED) == BODY


def test_a_content_hash_is_checked_against_the_bytes() -> None:
    good = "sha256:" + hashlib.sha256(BODY).hexdigest()
    check_content_hash(good, BODY, 0)
    check_content_hash(good.upper().replace("SHA256", "sha256"), BODY, 0)
    with pytest.raises(BadInput) as wrong:
        check_content_hash("sha256:" + "0" * 64, BODY, 3)
    assert (wrong.value.type, wrong.value.index) == ("hash_mismatch", 3)
    for malformed in ("md5:abc", "sha256:xyz", 7):
        with pytest.raises(BadInput) as bad:
            check_content_hash(malformed, BODY, 0)
        assert bad.value.type == "invalid_hash"


def test_per_item_preprocessing_is_refused_never_ignored() -> None:
    with pytest.raises(BadInput) as refused:
        fetch({"url": base64.b64encode(BODY).decode(), "max_dynamic_patch": 6}, CLOSED)
    assert refused.value.type == "invalid_setting"
    with pytest.raises(InvalidRequest):
        fetch({"image": "x"}, CLOSED)


def test_registrations_hold_distinct_urls_and_refuse_a_changed_count() -> None:
    regs = Registrations()
    regs.register("p", "127.0.0.1:5000", 2)
    regs.register("p", "127.0.0.1:5000", 2)
    assert regs.current("p") == (["127.0.0.1:5000"], 2)
    with pytest.raises(ValueError, match="Inconsistent receive_count"):
        regs.register("p", "127.0.0.1:5001", 3)
    regs.forget("p")
    assert len(regs) == 0


def test_a_registration_whose_encode_never_comes_is_dropped() -> None:
    regs = Registrations(ttl=0.2)
    regs.register("stale", "h:1", 1)
    time.sleep(0.3)
    regs.register("fresh", "h:2", 1)
    assert len(regs) == 1 and regs.current("fresh")[0] == ["h:2"]


def test_a_wait_returns_when_a_url_is_registered_after_the_last_look() -> None:
    async def scenario() -> float:
        regs = Registrations()
        regs.current("p")
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, regs.register, "p", "h:1", 1)
        started = loop.time()
        await regs.wait("p", 5.0)
        return loop.time() - started

    assert asyncio.run(scenario()) < 1.0


@pytest.mark.parametrize(("url", "endpoint"), [("10.1.2.3:5555", "tcp://10.1.2.3:5555"),
                                               ("[::1]:7", "tcp://[::1]:7"), ("::1:7", "tcp://[::1]:7")])
def test_a_receive_url_is_a_tcp_endpoint(url: str, endpoint: str) -> None:
    assert endpoint_of(url) == endpoint


@pytest.mark.parametrize("url", ["5555", "host:", "host:0", "host:99999", ":5"])
def test_a_malformed_receive_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError):
        endpoint_of(url)


def test_the_peer_really_reached_is_checked_too(site: str) -> None:
    # What a DNS answer that changed after the name's check would reach: refused at connect.
    from encode_server.api.sglang_fetch import _guarded, _Refused

    port = int(site.rsplit(":", 1)[1])
    with pytest.raises(_Refused, match=r"127\.0\.0\.1"):
        _guarded(False)(("127.0.0.1", port), 5)
    _guarded(True)(("127.0.0.1", port), 5).close()


def test_raw_base64_of_a_jpeg_is_base64_not_a_path(tmp_path: Path) -> None:
    """A JPEG's base64 starts with "/9j/": SGLang sends raw base64 as the client gave it."""
    jpeg = b"\xff\xd8\xff\xe0" + BODY
    encoded = base64.b64encode(jpeg).decode()
    assert encoded.startswith("/9j/")
    assert fetch(encoded, CLOSED) == jpeg
    assert fetch(encoded, FetchPolicy(max_bytes=1 << 20, timeout=10, file_dir=str(tmp_path))) == jpeg


@pytest.mark.parametrize(("entry", "path"), [
    ("/srv/media/cat.jpg", True), ("./cat.png", True), ("../x", True), ("~/cat.jpg", True),
    ("/9j/4AAQSkZJRgABAQ==", False), ("iVBORw0KGgo=", False),
])
def test_a_string_is_a_path_only_where_it_cannot_be_base64(entry: str, path: bool) -> None:
    assert _a_path(entry) is path


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2001:4860:4860::8888", True),
    ("100.100.100.200", False),  # shared address space: a cloud's metadata service lives there
    ("10.0.0.1", False), ("169.254.169.254", False), ("127.0.0.1", False), ("::1", False), ("fe80::1", False),
    ("::ffff:10.0.0.1", False), ("2002:c0a8:0101::1", False),  # 6to4 of 192.168.1.1
    ("224.0.0.1", False), ("0.0.0.0", False),
])
def test_only_globally_routable_addresses_are_public(address: str, public: bool) -> None:
    assert _public(address) is public


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/x", "http://[::1/x"])
def test_a_malformed_url_is_a_400_not_a_500(url: str) -> None:
    with pytest.raises(BadInput) as refused:
        fetch(url, OPEN)
    assert refused.value.type in ("url_refused", "fetch_failed")


def test_a_server_that_trickles_its_bytes_is_cut_at_the_time_limit(site: str) -> None:
    started = time.monotonic()
    with pytest.raises(BadInput) as refused:
        fetch(f"{site}/trickle", FetchPolicy(max_bytes=1 << 20, timeout=1.0, allow_private=True))
    assert refused.value.type == "fetch_failed"
    assert time.monotonic() - started < 3


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    with pytest.raises(BadInput) as refused:
        fetch(f"file://{fifo}", FetchPolicy(max_bytes=1 << 20, timeout=10, file_dir=str(tmp_path)))
    assert refused.value.type in ("url_refused", "fetch_failed")


def test_a_part_takes_no_more_urls_than_its_count_and_the_parts_held_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = Registrations()
    held.register("r_local_part_0", "h:1", 1)
    with pytest.raises(ValueError, match="already has its 1"):
        held.register("r_local_part_0", "h:2", 1)
    monkeypatch.setattr("encode_server.api.sglang_push.MAX_PARTS", 2)
    held.register("r_local_part_1", "h:1", 1)
    with pytest.raises(Full):
        held.register("r_local_part_2", "h:1", 1)
