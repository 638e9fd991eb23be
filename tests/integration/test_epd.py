"""The EPD request path against a real server: the client's hand-off, the chat-request rewrite,
the proxy's errors, and the hand-off to ``--export-dir`` alone. (vLLM itself: tests/vllm.)"""

from __future__ import annotations

import base64
import copy
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from encode_client import Client, ServerError, mm_hash
from encode_client.epd import EPDError, rewrite_chat_request
from encode_client.proxy import EPDProxy

from tests.images import image_bytes
from tests.redis_procs import delete_prefix
from tests.server import ServerProcess, free_port, start_server

pytestmark = pytest.mark.integration

PREFIX = f"test-epd-{os.getpid()}"
IMAGES = [image_bytes("PNG", 64, 48, seed=1), image_bytes("JPEG", 90, 120, seed=2)]


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat() -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image_url", "image_url": {"url": _url(IMAGES[0])}},
                    {"type": "image_url", "image_url": _url(IMAGES[1], "image/jpeg")},  # the string form
                ],
            },
        ],
    }


@pytest.fixture(scope="module")
def server(shared_redis_url: str, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server("--redis-url", shared_redis_url, "--cache-prefix", PREFIX, log_dir=server_logs)
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(shared_redis_url), PREFIX)


def test_rewrite_replaces_each_image_by_uuid_and_grid(server: ServerProcess, shared_redis_url: str) -> None:
    body = _chat()
    original = copy.deepcopy(body)
    with Client(server.url) as client:
        rewritten, results = rewrite_chat_request(body, client)
        again, second = rewrite_chat_request(body, client)
    assert body == original, "the caller's request is not changed"
    parts = rewritten["messages"][1]["content"]
    assert parts[0] == {"type": "text", "text": "compare"}
    assert rewritten["messages"][0] == original["messages"][0]
    store = redis.Redis.from_url(shared_redis_url)
    for part, data, result in zip(parts[1:], IMAGES, results, strict=True):
        assert part["type"] == "image_embeds" and part["uuid"] == mm_hash(data)
        assert part["image_embeds"] == {"image_grid_thw": result.meta["image_grid_thw"]}
        assert store.exists(result.key), "the embedding is in the shared tier when the rewrite returns"
    assert b"base64" not in repr(rewritten).encode()
    assert [r.status for r in results] == ["encoded", "encoded"]
    assert again == rewritten and [r.status for r in second] == ["hit", "hit"]


@pytest.mark.parametrize(
    ("url", "where", "words"),
    [
        ("http://example.com/cat.png", "messages[1].content[1]", "only data: URLs"),
        ("data:image/png,rawbytes", "messages[1].content[1]", "must be base64"),
        ("data:image/png;base64,%%%", "messages[1].content[1]", "not valid base64"),
    ],
)
def test_unreadable_parts_are_named(server: ServerProcess, url: str, where: str, words: str) -> None:
    body = _chat()
    body["messages"][1]["content"][1]["image_url"]["url"] = url
    with Client(server.url) as client, pytest.raises(EPDError, match=words) as info:
        rewrite_chat_request(body, client)
    assert info.value.where == where


def test_a_request_without_images_is_left_alone(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    with Client(server.url) as client:
        assert rewrite_chat_request(body, client) == (body, [])


@pytest.fixture()
def proxy_to_nowhere() -> Iterator[EPDProxy]:
    """A proxy whose encode-server and vLLM are both ports where nothing listens."""
    proxy = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{free_port()}", [f"http://127.0.0.1:{free_port()}"])
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


def test_proxy_errors_are_openai_shaped(proxy_to_nowhere: EPDProxy) -> None:
    url = proxy_to_nowhere.url
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("request body is not valid JSON")
    r = httpx.post(url + "/v1/chat/completions", content=b"", timeout=30)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "request body is empty; expected a JSON chat completion request", "type": "invalid_request_error",
        "param": None, "code": 400}
    r = httpx.post(url + "/v1/chat/completions", json=_chat(), timeout=60)
    assert r.status_code == 503 and r.json()["error"]["type"] == "encoder_unavailable"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_unavailable"
    r = httpx.get(url + "/v1/models", timeout=30)
    assert r.status_code == 502


def test_an_image_encode_server_cannot_read_is_a_400_naming_its_part(server: ServerProcess) -> None:
    """encode-server's own refusal of one image (``invalid_image``, with its index) comes back
    named by the part, as the proxy's own refusals are; vLLM (nowhere here) is never asked."""
    proxy = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{free_port()}", [server.url])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        body = _chat()
        body["messages"][1]["content"][2] = {"type": "image_url",
                                             "image_url": {"url": _url(b"\x89PNG\r\n\x1a\n not an image")}}
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text  # not 502: vLLM was never asked
        error = r.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "messages[1].content[2]")
        assert "encode-server refused this image: 400 invalid_image" in error["message"], error
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_hand_off_to_the_export_dir_alone(tmp_path: Path, server_logs: Path) -> None:
    """No Redis: the files are the shared tier, on disk when the answer comes."""
    export = tmp_path / "ec"
    proc = start_server("--export-dir", str(export), "--export-max-mb", "16", log_dir=server_logs)
    try:
        with Client(proc.url) as client:
            results = client.hand_off(IMAGES)
            for data, result in zip(IMAGES, results, strict=True):
                assert (export / mm_hash(data) / "encoder_cache.safetensors").is_file()
                assert result.data == b"" and result.meta["image_grid_thw"]
            assert (export / "FINGERPRINT").read_text().strip() == client.model()["fingerprint"]
    finally:
        proc.stop()
    bare = start_server(log_dir=server_logs)
    try:
        with Client(bare.url) as client, pytest.raises(ServerError) as info:
            client.hand_off(IMAGES[:1])
        assert info.value.status == 409 and info.value.type == "no_shared_tier"
    finally:
        bare.stop()


# -- issue 18: no client names an item; tenants through the EPD path ----------------------------

TENANT_PREFIX = f"test-epd-tenants-{os.getpid()}"
KEYS = {"acme": "key-acme-7f3a", "globex": "key-globex-91cd"}
KEY_SPEC = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())


@pytest.fixture(scope="module")
def tenant_server(shared_redis_url: str, server_logs: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        "--redis-url", shared_redis_url, "--cache-prefix", TENANT_PREFIX, "--tenant-isolation",
        "--api-keys", KEY_SPEC, log_dir=server_logs,
    )
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(shared_redis_url), TENANT_PREFIX)


def test_each_tenant_gets_its_own_identifier_for_one_image(tenant_server: ServerProcess, shared_redis_url: str) -> None:
    from encode_client.keys import store_key, tenant_digest

    body = _chat()
    h = mm_hash(IMAGES[0])
    with Client(tenant_server.url, api_key=KEYS["acme"]) as acme, Client(
        tenant_server.url, api_key=KEYS["globex"]
    ) as globex:
        fingerprint = acme.model()["fingerprint"]
        a, _ = rewrite_chat_request(body, acme)
        assert globex.lookup([h])[0].cached is False, "acme's image is no hit for globex (no existence oracle)"
        b, b_results = rewrite_chat_request(body, globex)
    uuid_a, uuid_b = (r["messages"][1]["content"][1]["uuid"] for r in (a, b))
    assert uuid_a == f"t:{tenant_digest('acme')}:{h}" and uuid_b == f"t:{tenant_digest('globex')}:{h}"
    assert [r.status for r in b_results] == ["encoded", "encoded"], "globex's images are encoded for globex"
    store = redis.Redis.from_url(shared_redis_url)
    for tenant in KEYS:
        assert store.exists(store_key(fingerprint, h, prefix=TENANT_PREFIX, tenant=tenant))
    assert not store.exists(store_key(fingerprint, h, prefix=TENANT_PREFIX))


ATTACKS = {
    "image_embeds under another image's hash": {
        "type": "image_embeds", "image_embeds": {"image_embeds": "AAAA", "image_grid_thw": [1, 4, 4]},
        "uuid": mm_hash(IMAGES[0]),
    },
    "a text part smuggling an image under a uuid": {
        "type": "text", "text": "look", "image_url": {"url": _url(IMAGES[1])}, "uuid": mm_hash(IMAGES[0]),
    },
    "an untyped image_url": {"image_url": {"url": "http://169.254.169.254/latest"}},
}


@pytest.mark.parametrize("part", ATTACKS.values(), ids=ATTACKS.keys())
def test_the_proxy_refuses_a_part_naming_an_item_before_anything_moves(
    proxy_to_nowhere: EPDProxy, part: dict
) -> None:
    body = _chat()
    body["messages"][1]["content"].insert(2, part)
    r = httpx.post(proxy_to_nowhere.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text  # not 503: encode-server was never asked, nor vLLM
    assert r.json()["error"] | {"message": None} == {
        "type": "invalid_request_error", "param": "messages[1].content[2]", "code": 400, "message": None
    }


@pytest.mark.parametrize(
    "field", ["mm_processor_kwargs", "media_io_kwargs", "kv_transfer_params", "ec_transfer_params"]
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_the_proxy_refuses_fields_that_steer_vllms_caches(proxy_to_nowhere: EPDProxy, field: str, route: str) -> None:
    body = {"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], field: {"max_pixels": 1}}
    r = httpx.post(proxy_to_nowhere.url + route, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/pooling"), ("POST", "/v1/embeddings"),
     ("POST", "/invocations"), ("POST", "/inference/v1/generate"), ("POST", "/v1/messages"),
     ("POST", "/reset_prefix_cache"), ("GET", "/server_info"), ("DELETE", "/v1/models"), ("POST", "/v1/models")],
)
def test_the_proxy_forwards_only_the_routes_it_checks(proxy_to_nowhere: EPDProxy, method: str, path: str) -> None:
    """Each of these vLLM routes takes content the proxy does not check (a part with a uuid in
    /v1/responses, /tokenize, /pooling, /invocations...): a 404 from the proxy, never a 502 (forwarded)."""
    body = {"messages": [{"role": "user", "content": [ATTACKS["image_embeds under another image's hash"]]}]}
    r = httpx.request(method, proxy_to_nowhere.url + path, json=body, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


@pytest.fixture()
def keyed_proxy(tenant_server: ServerProcess) -> Iterator[EPDProxy]:
    """A proxy that authenticates its callers, in front of the tenant server; vLLM is nowhere."""
    proxy = EPDProxy(("127.0.0.1", 0), f"http://127.0.0.1:{free_port()}", [tenant_server.url], api_keys=KEY_SPEC)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


def test_the_proxy_hands_each_callers_images_off_under_the_callers_own_key(
    keyed_proxy: EPDProxy, tenant_server: ServerProcess, shared_redis_url: str
) -> None:
    from encode_client.keys import store_key

    image = image_bytes("PNG", 40, 30, seed=18)
    h = mm_hash(image)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(image)}}]}]}
    url = keyed_proxy.url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEYS['acme']}"}):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        assert r.headers["www-authenticate"] == "Bearer" and KEYS["acme"] not in r.text
    assert httpx.get(keyed_proxy.url + "/health", timeout=30).status_code == 502  # a probe: no key, forwarded
    assert httpx.get(keyed_proxy.url + "/v1/models", timeout=30).status_code == 401

    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEYS['globex']}"}, timeout=60)
    assert r.status_code == 502, r.text  # handed off, then vLLM (nowhere) did not answer
    with Client(tenant_server.url, api_key=KEYS["globex"]) as client:
        fingerprint = client.model()["fingerprint"]
    store = redis.Redis.from_url(shared_redis_url)
    assert store.exists(store_key(fingerprint, h, prefix=TENANT_PREFIX, tenant="globex"))
    assert not store.exists(store_key(fingerprint, h, prefix=TENANT_PREFIX, tenant="acme"))


def test_the_proxy_refuses_one_key_for_all_and_per_caller_keys_together() -> None:
    with pytest.raises(ValueError, match="not both"):
        EPDProxy(("127.0.0.1", 0), "http://127.0.0.1:1", ["http://127.0.0.1:1"], api_key="k", api_keys=KEY_SPEC)
