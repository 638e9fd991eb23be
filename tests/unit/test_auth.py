from __future__ import annotations

import pytest

from encode_server.auth import ApiKeys, parse_api_keys
from encode_server.config import Settings, settings_from
from encode_server.core.errors import Unauthorized


def test_keys_come_from_both_flags_and_the_environment_with_optional_tenants() -> None:
    s = settings_from(["--api-key", "solo", "--tenant-isolation"], {"ENCODE_SERVER_API_KEYS": "k1, acme:k2,,"})
    keys = ApiKeys.from_settings(s)
    assert keys is not None and len(keys) == 3 and s.tenant_isolation is True
    assert [keys.authenticate(f"Bearer {k}") for k in ("solo", "k1", "k2")] == [None, None, "acme"]
    assert keys.authenticate("bearer   k2 ") == "acme"
    assert ApiKeys.from_settings(Settings()) is None
    assert settings_from(["--no-tenant-isolation"], {"ENCODE_SERVER_TENANT_ISOLATION": "1"}).tenant_isolation is False


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong", "Basic k2", "k2", "Bearer k"])
def test_anything_but_a_configured_bearer_key_is_unauthorized(header: str | None) -> None:
    keys = ApiKeys(parse_api_keys("acme:k2"))
    with pytest.raises(Unauthorized) as caught:
        keys.authenticate(header)
    assert caught.value.type == "unauthorized" and "k2" not in caught.value.message


def test_malformed_or_ambiguous_keys_are_refused_without_echoing_them() -> None:
    for spec in ("acme:", ":secret-1", "acme:has space"):
        with pytest.raises(ValueError) as caught:
            parse_api_keys(spec)
        assert "secret-1" not in str(caught.value) and "has space" not in str(caught.value)
    with pytest.raises(ValueError, match="two different tenants"):
        ApiKeys([("a", "same"), ("b", "same")])


def test_keys_never_show_in_a_repr() -> None:
    s = Settings(api_key="top-secret-1", api_keys="acme:top-secret-2")
    assert "top-secret" not in repr(s)
    keys = ApiKeys.from_settings(s)
    assert "top-secret" not in repr(keys)
