"""Issue 18, as a hostile client would try it, against the real stack: vLLM's OpenAI server (an EC
consumer with ``EncodeServerECConnector``), encode-server, Redis and ``encode-epd-proxy``.

vLLM keeps what it computed for an item under the item's identifier, for every later request that
names it. The attacks name a victim's image (its ``mm_hash``, which anyone can compute) before the
victim sends it; the victim's answer must then still be plain vLLM's answer on the pixels.
Every victim image is sent by one test only, so no test depends on what another left in vLLM.

Shares the session's vLLM servers (the tower-free consumer behind the proxy, plain vLLM with its
tower for the answers on the pixels) and encode-server with test_proxy.py (conftest.py).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from encode_client import Client, mm_hash
from encode_client.epd import cache_salt
from encode_client.keys import embeds_identifier, store_key, tenant_digest
from encode_client.proxy import EPDProxy

from tests.server import ServerProcess, start_server
from tests.vllm.conftest import EPD_PREFIX, REDIS_URL, metric, png, running_proxy, stored_value
from tests.vllm.epd_stack import Relay, chat, data_url, post_chat

SIZE = (112, 84)  # not resized by the processor: a 12-row embedding
ATTACKER_PIXELS = png(*SIZE, seed=1800)
KEYS = {"acme": "key-acme-5be1", "globex": "key-globex-0c77"}


@dataclass(frozen=True)
class Geometry:
    grid: list[int]
    rows: int
    width: int


@pytest.fixture(scope="module")
def geometry(epd_server: ServerProcess) -> Geometry:
    """The victims' grid and embedding shape, from encode-server (no image is sent)."""
    r = httpx.post(epd_server.url + "/v1/tokens", json={"sizes": [list(SIZE)]}, timeout=30).json()["items"][0]
    width = httpx.get(epd_server.url + "/v1/model", timeout=30).json()["hidden_size"]
    return Geometry(r["meta"]["image_grid_thw"], r["num_tokens"], width)


@pytest.fixture(scope="module")
def proxy(relay: Relay, epd_server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [epd_server.url]) as p:
        yield p


@pytest.fixture(scope="module")
def trusted_proxy(relay: Relay, epd_server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [epd_server.url], trust_client_embeds=True) as p:
        yield p


def tensor_b64(array: np.ndarray) -> str:
    """What vLLM reads from an embeddings part: base64 of ``torch.save``."""
    import torch

    buf = io.BytesIO()
    torch.save(torch.from_numpy(array), buf)
    return base64.b64encode(buf.getvalue()).decode()


def embeds(g: Geometry, fill: float) -> dict[str, Any]:
    return {"image_embeds": tensor_b64(np.full((g.rows, g.width), fill, dtype=np.float32)), "image_grid_thw": g.grid}


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def plain(plain_vllm: dict[str, Any], image: bytes) -> str:
    """Plain vLLM's own answer on the pixels (its tower; no uuid: vLLM hashes the item itself)."""
    return answer(post_chat(plain_vllm["url"], chat([image])))


def given(vllm_server: dict[str, Any], payload: dict[str, Any]) -> str:
    """vLLM's own answer for an embedding given directly (no uuid; the tower-free consumer takes it)."""
    return answer(post_chat(vllm_server["url"], chat([], {"type": "image_embeds", "image_embeds": payload})))


ATTACKS = {
    "image_embeds under the victim's hash (the issue)": lambda h, g: {
        "type": "image_embeds", "image_embeds": embeds(g, 0.0), "uuid": h,
    },
    "untyped image_embeds under the victim's hash": lambda h, g: {"image_embeds": embeds(g, 0.0), "uuid": h},
    "a text part smuggling other pixels under the victim's hash": lambda h, g: {
        "type": "text", "text": "look", "image_url": {"url": data_url(ATTACKER_PIXELS)}, "uuid": h,
    },
    "input_image with other pixels under the victim's hash": lambda h, g: {
        "type": "input_image", "image_url": data_url(ATTACKER_PIXELS), "uuid": h,
    },
}


@pytest.mark.parametrize("attack", ATTACKS, ids=list(ATTACKS))
def test_an_attack_through_the_proxy_is_refused_and_the_victim_sees_its_pixels(
    attack: str, proxy: EPDProxy, relay: Relay, plain_vllm: dict[str, Any], geometry: Geometry
) -> None:
    """Each shape is one vLLM 0.32 caches under the client's uuid (the control test below shows
    two of them poisoning vLLM when sent to it directly; the old proxy forwarded all four)."""
    victim = png(*SIZE, seed=1810 + list(ATTACKS).index(attack))
    mark = relay.mark()
    r = post_chat(proxy.url, chat([], ATTACKS[attack](mm_hash(victim), geometry)))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    assert relay.since(mark) == b"", "a refused request reached vLLM"
    assert answer(post_chat(proxy.url, chat([victim]))) == plain(plain_vllm, victim)


ROUTE_ATTACKS = {  # both poison vLLM when forwarded (measured against the old proxy, which forwarded every route)
    "/v1/responses": lambda h: {
        "model": "tiny", "max_output_tokens": 8, "temperature": 0,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(ATTACKER_PIXELS), "uuid": h},
            {"type": "input_text", "text": "describe the image"},
        ]}],
    },
    "/invocations": lambda h: chat([], ATTACKS["a text part smuggling other pixels under the victim's hash"](h, None)),
}


@pytest.mark.parametrize("route", ROUTE_ATTACKS)
def test_an_attack_on_another_vllm_route_is_not_forwarded(
    route: str, proxy: EPDProxy, relay: Relay, plain_vllm: dict[str, Any]
) -> None:
    victim = png(*SIZE, seed=1815 + list(ROUTE_ATTACKS).index(route))
    mark = relay.mark()
    r = httpx.post(proxy.url + route, json=ROUTE_ATTACKS[route](mm_hash(victim)), timeout=120)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert relay.since(mark) == b""
    assert answer(post_chat(proxy.url, chat([victim]))) == plain(plain_vllm, victim)


def test_control_a_client_that_reaches_vllm_directly_poisons_every_user(
    proxy: EPDProxy, vllm_server: dict[str, Any], plain_vllm: dict[str, Any], geometry: Geometry
) -> None:
    """Why only the proxy may reach vLLM (deploy/): zeros under the victim's hash, sent to vLLM
    itself, decide what the model sees in the victim's image, whatever the proxy does. Also shows
    that the test above would catch a poisoned answer."""
    victim = png(*SIZE, seed=1820)
    attack = ATTACKS["image_embeds under the victim's hash (the issue)"]
    assert answer(post_chat(vllm_server["url"], chat([], attack(mm_hash(victim), geometry))))
    victims = answer(post_chat(proxy.url, chat([victim])))
    assert victims == given(vllm_server, embeds(geometry, 0.0)) != plain(plain_vllm, victim)


def test_control_the_tower_free_consumer_refuses_pixels_itself(
    proxy: EPDProxy, vllm_server: dict[str, Any], plain_vllm: dict[str, Any]
) -> None:
    """Other pixels smuggled under the victim's hash poisoned a consumer with its tower (the attack
    table of docs/vllm.md); the tower-free consumer takes no pixels at all, from anyone: vLLM
    answers 400 itself, and the victim then sees its own pixels."""
    victim = png(*SIZE, seed=1821)
    attack = ATTACKS["a text part smuggling other pixels under the victim's hash"]
    r = post_chat(vllm_server["url"], chat([], attack(mm_hash(victim), None)))
    assert r.status_code == 400 and "At most 0 image(s)" in r.text, r.text
    assert answer(post_chat(proxy.url, chat([victim]))) == plain(plain_vllm, victim)


def test_trusted_embeddings_are_served_only_to_requests_that_send_them(
    trusted_proxy: EPDProxy, relay: Relay, vllm_server: dict[str, Any], plain_vllm: dict[str, Any],
    geometry: Geometry,
) -> None:
    """With --trust-client-embeds the caller's tensor is used, named by its content: the victim
    named by its uuid still sees its pixels; the same tensor under any uuid is one item."""
    victim = png(*SIZE, seed=1830)
    zeros, ones = embeds(geometry, 0.0), embeds(geometry, 1.0)
    mark = relay.mark()
    attacker = answer(post_chat(trusted_proxy.url, chat([], {"type": "image_embeds", "image_embeds": zeros,
                                                             "uuid": mm_hash(victim)})))
    assert relay.uuids_since(mark) == [embeds_identifier("image_embeds", zeros)]
    assert mm_hash(victim).encode() not in relay.since(mark)
    assert attacker == given(vllm_server, zeros), "the caller's own tensor answers the caller"

    victims = answer(post_chat(trusted_proxy.url, chat([victim])))
    assert victims == plain(plain_vllm, victim) != attacker

    mark = relay.mark()
    again = answer(post_chat(trusted_proxy.url, chat([], {"type": "image_embeds", "image_embeds": zeros,
                                                          "uuid": "another"})))
    other = answer(post_chat(trusted_proxy.url, chat([], {"type": "image_embeds", "image_embeds": ones})))
    assert relay.uuids_since(mark) == [embeds_identifier("image_embeds", p) for p in (zeros, ones)]
    assert again == attacker
    assert other == given(vllm_server, ones) != attacker, "another tensor is another item"


# -- tenants ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_server(model_dir: Path, logs: Path, epd_server: ServerProcess) -> Iterator[ServerProcess]:
    """encode-server with tenant isolation, on the same Redis prefix the vLLM connector reads
    (its keys are deleted with epd_server's)."""
    spec = ",".join(f"{t}:{k}" for t, k in KEYS.items())
    proc = start_server(
        "--model", str(model_dir), "--redis-url", REDIS_URL, "--cache-prefix", EPD_PREFIX, "--grpc-port", "0",
        "--tenant-isolation", "--api-keys", spec, "--dtype", "float32", log_dir=logs,
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tenant_proxy(relay: Relay, tenant_server: ServerProcess) -> Iterator[EPDProxy]:
    with running_proxy(relay.url, [tenant_server.url], api_keys=",".join(f"{t}:{k}" for t, k in KEYS.items())) as p:
        yield p


def test_two_tenants_one_image_are_isolated_end_to_end(
    tenant_proxy: EPDProxy, tenant_server: ServerProcess, relay: Relay, vllm_server: dict[str, Any],
    plain_vllm: dict[str, Any], geometry: Geometry,
) -> None:
    """encode-server, Redis keys and the identifiers vLLM sees: one image, two tenants, two items.

    globex's entry in Redis is replaced by zeros before globex sends the image (as a Redis writer
    could): globex's answer follows globex's entry and acme's follows acme's, in both orders. With
    one identifier for both (plain mm_hash, or one encode-server key for all callers) vLLM would
    answer the second from the first's cached item; with the connector reading the wrong tenant's
    key, globex would get acme's embedding."""
    image = png(*SIZE, seed=1840)
    h = mm_hash(image)
    with Client(tenant_server.url, api_key=KEYS["acme"]) as acme_client:
        fingerprint = str(acme_client.model()["fingerprint"])
    store = redis.Redis.from_url(REDIS_URL)
    key = {t: store_key(fingerprint, h, prefix=EPD_PREFIX, tenant=t) for t in KEYS}

    mark = relay.mark()
    acme = answer(post_chat(tenant_proxy.url, chat([image]), key=KEYS["acme"]))
    assert relay.uuids_since(mark) == [f"t:{tenant_digest('acme')}:{h}"]
    assert relay.salts_since(mark) == [cache_salt("acme")]
    assert KEYS["acme"].encode() not in relay.since(mark), "a caller's key never reaches vLLM"
    assert store.exists(key["acme"]) and not store.exists(key["globex"])
    assert not store.exists(store_key(fingerprint, h, prefix=EPD_PREFIX))
    with Client(tenant_server.url, api_key=KEYS["globex"]) as globex_client:
        assert globex_client.lookup([h])[0].cached is False, "acme's image is no hit for globex"

    zeros = np.zeros((geometry.rows, geometry.width), dtype=np.float32)
    store.set(key["globex"], stored_value(zeros, fingerprint, h, {"image_grid_thw": geometry.grid}))
    mark = relay.mark()
    globex = answer(post_chat(tenant_proxy.url, chat([image]), key=KEYS["globex"]))
    assert relay.uuids_since(mark) == [f"t:{tenant_digest('globex')}:{h}"]
    assert relay.salts_since(mark) == [cache_salt("globex")]

    assert acme == plain(plain_vllm, image)
    assert globex == given(vllm_server, embeds(geometry, 0.0)) != acme
    assert answer(post_chat(tenant_proxy.url, chat([image]), key=KEYS["acme"])) == acme

    text = httpx.get(tenant_server.url + "/metrics", timeout=10).text
    assert metric(text, "encode_server_items_total", status="encoded") == 1, "globex's was a hit on its own entry"
    r = post_chat(tenant_proxy.url, chat([image]))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
