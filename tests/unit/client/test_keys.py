"""The client's copy of the store key layout is the server's, byte for byte."""

from __future__ import annotations

import pytest
from encode_client.keys import (
    StoredIdentifier,
    epd_identifier,
    identifier_key,
    parse_identifier,
    store_key,
    tenant_digest,
)

from encode_server.core.hashing import CacheKey, cache_key
from encode_server.core.hashing import tenant_digest as server_tenant_digest
from encode_server.core.types import MODALITIES

FP = "ab" * 32
H = "0123456789abcdef" * 4


@pytest.mark.parametrize("modality", MODALITIES)
@pytest.mark.parametrize("tenant", [None, "acme", "a:b", "ténant ünïcode", "x" * 300])
@pytest.mark.parametrize("prefix", ["encode", "prod:encode", "video", "t"])
def test_store_key_equals_the_servers_cache_key(tenant: str | None, prefix: str, modality: str) -> None:
    key = cache_key(FP, H, prefix=prefix, tenant=tenant, modality=modality)
    assert store_key(FP, H, prefix=prefix, tenant=tenant, modality=modality) == key


@pytest.mark.parametrize("modality", MODALITIES)
@pytest.mark.parametrize("tenant", [None, "acme", "a:b"])
@pytest.mark.parametrize("prefix", ["encode", "prod:encode", "video", "t", "x:t"])
def test_the_identifier_read_from_a_servers_key_is_the_servers_and_names_the_key_back(
    tenant: str | None, prefix: str, modality: str
) -> None:
    key = CacheKey(FP, H, prefix, tenant, modality)
    identifier = epd_identifier(key.text, H, modality)
    assert identifier == key.identifier
    assert identifier_key(FP, identifier, prefix=prefix) == key.text
    digest = server_tenant_digest(tenant) if tenant is not None else None
    assert parse_identifier(identifier) == StoredIdentifier(digest, modality, H)


def test_a_video_and_an_image_of_the_same_bytes_get_two_identifiers() -> None:
    image, video = (epd_identifier(cache_key(FP, H, modality=m), H, m) for m in ("image", "video"))
    assert image == H and video == f"video:{H}"
    for key, modality in ((cache_key(FP, H, modality="video"), "image"), (cache_key(FP, H), "video")):
        with pytest.raises(ValueError, match=f"not of a {modality}"):  # the other modality's key
            epd_identifier(key, H, modality)


@pytest.mark.parametrize(
    "key",
    [f"encode:v1:{FP}:text:{H}", f"encode:v1:{FP}:video:video:{H}", f"encode:v1:{FP}:{H}:video", f"video:{H}"],
)
def test_a_key_with_an_unknown_or_misplaced_modality_is_refused(key: str) -> None:
    with pytest.raises(ValueError):
        epd_identifier(key, H)


@pytest.mark.parametrize("identifier", [f"text:{H}", f"video:{H[:-1]}", f"video:t:{FP}:{H}", "e:" + H, f"VIDEO:{H}"])
def test_an_identifier_that_names_no_stored_item_parses_to_none(identifier: str) -> None:
    assert parse_identifier(identifier) is None
    assert identifier_key(FP, identifier) is None


def test_tenant_digest_equals_the_servers() -> None:
    for tenant in ("t", "acme", "\udcff lone surrogate"):
        assert tenant_digest(tenant) == server_tenant_digest(tenant)


@pytest.mark.parametrize(
    ("fingerprint", "mm_hash", "prefix"),
    [(FP.upper(), H, "encode"), (FP, H[:-1], "encode"), (FP, H, "has space"), (FP, H, ""), (FP, "z" * 64, "encode")],
)
def test_bad_parts_are_refused(fingerprint: str, mm_hash: str, prefix: str) -> None:
    with pytest.raises(ValueError):
        store_key(fingerprint, mm_hash, prefix=prefix)
    with pytest.raises(ValueError):
        tenant_digest("")


S = "5e" * 32  # a settings digest


@pytest.mark.parametrize("modality", MODALITIES)
@pytest.mark.parametrize("tenant", [None, "acme", "a:b"])
@pytest.mark.parametrize("prefix", ["encode", "p", "x:p", "t", "x:t:p"])
def test_a_settings_key_is_the_servers_and_its_identifier_reads_back_from_the_right(
    tenant: str | None, prefix: str, modality: str
) -> None:
    key = CacheKey(FP, H, prefix, tenant, modality, S)
    assert store_key(FP, H, prefix=prefix, tenant=tenant, modality=modality, settings=S) == key.text
    identifier = epd_identifier(key.text, H, modality)
    assert identifier == key.identifier
    assert identifier_key(FP, identifier, prefix=prefix) == key.text
    digest = server_tenant_digest(tenant) if tenant is not None else None
    assert parse_identifier(identifier) == StoredIdentifier(digest, modality, H, S)


def test_one_image_under_other_settings_gets_another_identifier_and_the_defaults_keep_todays() -> None:
    plain, tuned = (epd_identifier(cache_key(FP, H, settings=s), H) for s in (None, S))
    assert plain == H and tuned == f"p:{S}:{H}"
    assert parse_identifier(plain) == StoredIdentifier(None, "image", H, None)
