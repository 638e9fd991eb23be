"""The client's copy of the store key layout is the server's, byte for byte."""

from __future__ import annotations

import pytest
from encode_client.keys import store_key, tenant_digest

from encode_server.core.hashing import cache_key
from encode_server.core.hashing import tenant_digest as server_tenant_digest

FP = "ab" * 32
H = "0123456789abcdef" * 4


@pytest.mark.parametrize("tenant", [None, "acme", "a:b", "ténant ünïcode", "x" * 300])
@pytest.mark.parametrize("prefix", ["encode", "prod:encode"])
def test_store_key_equals_the_servers_cache_key(tenant: str | None, prefix: str) -> None:
    assert store_key(FP, H, prefix=prefix, tenant=tenant) == cache_key(FP, H, prefix=prefix, tenant=tenant)


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
