"""What the EPD rewrite lets through to vLLM, without I/O: no client ever names an item (issue 18).

Each refused shape is one that vLLM 0.32 reads as an item under a client-chosen identifier
(``vllm/renderers/chat_utils.py``, ``_parse_chat_message_content_mm_part``: a ``uuid`` on any
part sends it down the path that looks for ``image_url`` / ``image_embeds`` / ... keys).
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from encode_client import mm_hash
from encode_client._callers import Callers
from encode_client.epd import EPDError, cache_salt, check_chat_request
from encode_client.keys import embeds_identifier, epd_identifier, identifier_key, store_key, tenant_digest

from encode_server.auth import parse_api_keys
from encode_server.core.hashing import cache_key

PNG = b"\x89PNG\r\n\x1a\n not decoded here"
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
VICTIM = "ab" * 32
EMBEDS = {"image_embeds": "AAAA", "image_grid_thw": [1, 4, 4]}
FP = "cd" * 32


def body(*parts: Any, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": list(parts)}], **fields}


REFUSED_PARTS = {
    "image_embeds under a victim's hash (the issue's attack)": {"type": "image_embeds", "image_embeds": EMBEDS,
                                                                "uuid": VICTIM},
    "image_embeds without a uuid": {"type": "image_embeds", "image_embeds": EMBEDS},
    "video_embeds": {"type": "video_embeds", "video_embeds": "AAAA", "uuid": VICTIM},
    "audio_embeds": {"type": "audio_embeds", "audio_embeds": "AAAA"},
    "untyped image_embeds": {"image_embeds": EMBEDS, "uuid": VICTIM},
    "untyped image_url (vLLM would load it, past the data:-only rule)": {"image_url": {"url": "http://x/a.png"}},
    "a text part smuggling an image under a uuid": {"type": "text", "text": "look", "image_url": {"url": URL},
                                                    "uuid": VICTIM},
    "image_url with a uuid": {"type": "image_url", "image_url": {"url": URL}, "uuid": VICTIM},
    "input_image with a uuid": {"type": "input_image", "image_url": URL, "uuid": VICTIM},
    "a uuid-only reference to whatever vLLM caches": {"type": "image_url", "image_url": None, "uuid": VICTIM},
    "a null uuid": {"type": "image_url", "image_url": {"url": URL}, "uuid": None},
    "a type that is not a string": {"type": ["image_url"], "image_url": {"url": URL}},
}


@pytest.mark.parametrize("part", REFUSED_PARTS.values(), ids=REFUSED_PARTS.keys())
def test_parts_that_name_an_item_are_refused_and_named(part: dict[str, Any]) -> None:
    request = body({"type": "text", "text": "first"}, part)
    with pytest.raises(EPDError) as info:
        check_chat_request(request)
    assert info.value.where == "messages[1].content[1]"


@pytest.mark.parametrize(
    ("field", "value"),
    [("mm_processor_kwargs", {"max_pixels": 3136}), ("media_io_kwargs", {"image": {"mode": "L"}}),
     ("kv_transfer_params", {"remote_host": "x"}), ("ec_transfer_params", {"x": 1})],
)
def test_fields_that_steer_vllms_caches_are_refused(field: str, value: object) -> None:
    with pytest.raises(EPDError) as info:
        check_chat_request(body({"type": "image_url", "image_url": {"url": URL}}, **{field: value}))
    assert info.value.where == field
    check_chat_request(body({"type": "text", "text": "x"}, **{field: None}))  # unset is fine


def test_images_text_and_other_media_pass() -> None:
    plan = check_chat_request(
        body(
            "a string part",
            {"type": "text", "text": "t"},
            {"type": "image_url", "image_url": {"url": URL}},
            {"type": "input_image", "image_url": URL},
            {"type": "image_url", "image_url": URL},
        )
    )
    assert [(p.message, p.part, p.data) for p in plan.images] == [(1, 2, PNG), (1, 3, PNG), (1, 4, PNG)]
    assert plan.embeds == []


def test_a_trusted_caller_s_embeddings_are_kept_without_its_uuid() -> None:
    plan = check_chat_request(body({"type": "image_embeds", "image_embeds": EMBEDS, "uuid": VICTIM}),
                              trust_client_embeds=True)
    assert [(e.type, e.payload) for e in plan.embeds] == [("image_embeds", EMBEDS)]
    with pytest.raises(EPDError, match="payload"):
        check_chat_request(body({"type": "image_embeds", "uuid": VICTIM}), trust_client_embeds=True)
    with pytest.raises(EPDError):  # trust covers embeddings, never a uuid on another part
        check_chat_request(body({"type": "image_url", "image_url": {"url": URL}, "uuid": VICTIM}),
                           trust_client_embeds=True)


def test_an_embeddings_identifier_is_its_payloads_and_never_an_images() -> None:
    ident = embeds_identifier("image_embeds", EMBEDS)
    assert ident == embeds_identifier("image_embeds", dict(reversed(EMBEDS.items())))  # key order is not content
    assert ident.startswith("e:") and VICTIM not in ident
    others = [
        embeds_identifier("video_embeds", EMBEDS),
        embeds_identifier("image_embeds", {**EMBEDS, "image_embeds": "AAAB"}),
        embeds_identifier("image_embeds", {**EMBEDS, "image_grid_thw": [1, 4, 5]}),
        embeds_identifier("image_embeds", "AAAA"),
    ]
    assert len({ident, *others}) == 5
    assert identifier_key(FP, ident) is None, "the connector never reads an e: identifier from the store"


@pytest.mark.parametrize("tenant", [None, "acme", "a:b"])
@pytest.mark.parametrize("prefix", ["encode", "prod:encode", "t"])
def test_an_identifier_names_exactly_its_store_key(tenant: str | None, prefix: str) -> None:
    h = mm_hash(PNG)
    key = cache_key(FP, h, prefix=prefix, tenant=tenant)  # what the server hands back
    ident = epd_identifier(key, h)
    assert ident == (h if tenant is None else f"t:{tenant_digest(tenant)}:{h}")
    assert identifier_key(FP, ident, prefix=prefix) == key == store_key(FP, h, prefix=prefix, tenant=tenant)


def test_two_tenants_get_two_identifiers_for_one_image() -> None:
    h = mm_hash(PNG)
    a, b = (epd_identifier(cache_key(FP, h, tenant=t), h) for t in ("acme", "globex"))
    assert a != b and a != h and b != h


@pytest.mark.parametrize(
    "key",
    [
        "encode:v1:" + FP + ":" + "ef" * 32,  # another image's key
        "encode:v2:" + FP + ":" + mm_hash(PNG),
        "v1:" + FP + ":" + mm_hash(PNG),
        "encode:v1:" + FP[:-1] + ":" + mm_hash(PNG),
        "encode:v1:" + FP + ":t:" + "zz" * 32 + ":" + mm_hash(PNG),
        "encode:v1:" + FP + ":t::" + mm_hash(PNG),
    ],
)
def test_a_key_of_another_shape_or_image_gives_no_identifier(key: str) -> None:
    with pytest.raises(ValueError):
        epd_identifier(key, mm_hash(PNG))


@pytest.mark.parametrize(
    "identifier",
    ["e:" + "ab" * 32, "t:" + "ab" * 32, "t:" + "ab" * 32 + ":" + "AB" * 32, "../" + "ab" * 32, "ab" * 32 + ":x",
     "t:" + "ab" * 31 + ":" + "ab" * 32, "", "x" * 64],
)
def test_the_connector_reads_no_key_for_a_malformed_identifier(identifier: str) -> None:
    assert identifier_key(FP, identifier) is None


def test_cache_salts_are_apart_per_tenant_and_a_clients_salt_stays_in_its_tenant() -> None:
    salts = {cache_salt(t, s) for t in (None, "acme", "globex") for s in (None, "mine")}
    assert len(salts) == 6
    assert cache_salt("acme") == cache_salt("acme", None)
    # a caller without a tenant cannot pick acme's salt by sending it as its own
    assert cache_salt(None, cache_salt("acme")) != cache_salt("acme")
    assert all(len(s) == 64 for s in salts)  # vLLM takes salts of at most 128 characters


@pytest.mark.parametrize("spec", ["k1", "acme:k2, globex:k3", "a:b:c", " k1 , acme:k2 ,", "tenant é:kéy"])
def test_the_proxy_reads_api_keys_as_the_server_does(spec: str) -> None:
    assert sorted((c.tenant or "", c.key) for c in Callers(spec)) == sorted(
        (t or "", k) for t, k in parse_api_keys(spec)
    )


@pytest.mark.parametrize("spec", ["", ":k", "acme:", "a b", "acme:k1,globex:k1"])
def test_malformed_key_lists_are_refused_without_showing_a_key(spec: str) -> None:
    with pytest.raises(ValueError) as info:
        Callers(spec)
    assert "k1" not in str(info.value)


def test_callers_are_authenticated_by_their_bearer_key() -> None:
    callers = Callers("acme:key-a,globex:key-b,plain")
    assert callers.authenticate("Bearer key-a").tenant == "acme"  # type: ignore[union-attr]
    assert callers.authenticate("bearer  key-b ").tenant == "globex"  # type: ignore[union-attr]
    found = callers.authenticate("Bearer plain")
    assert found is not None and found.tenant is None
    for header in (None, "", "Bearer", "Basic key-a", "Bearer key-c", "key-a"):
        assert callers.authenticate(header) is None
