"""SGLang's routes exist only with ``--sglang``, are counted under their own route label, and stay out
of the OpenAPI document (they are SGLang's protocol, not encode-server's API)."""

from __future__ import annotations

import asyncio

import pytest

from encode_server.api.http import create_app
from encode_server.api.runtime import Runtime
from encode_server.api.sglang import ROUTES, SglangDoor
from encode_server.config import Settings, settings_from
from encode_server.metrics import Metrics


def paths(app: object) -> set[str]:
    return {getattr(route, "path", "") for route in app.routes}  # type: ignore[attr-defined]


def test_without_sglang_there_are_no_sglang_routes() -> None:
    app = create_app(Runtime(Settings(), Metrics()))
    assert not set(ROUTES) & paths(app)


def test_with_sglang_its_routes_are_served_but_not_documented() -> None:
    runtime = Runtime(settings_from(["--sglang"]), Metrics())
    door = SglangDoor(runtime)
    try:
        app = create_app(runtime, door)
        assert set(ROUTES) <= paths(app)
        assert not set(ROUTES) & set(app.openapi()["paths"])
    finally:
        door.pusher.close()


@pytest.mark.parametrize("flag", [["--sglang-fetch-private"], ["--sglang-file-dir", "/srv"],
                                  ["--sglang-register-urls", "http://p:8997"], ["--sglang-url", "http://e:8000"]])
def test_a_sglang_flag_without_sglang_is_refused(flag: list[str]) -> None:
    with pytest.raises(SystemExit, match="needs --sglang"):
        settings_from(flag)


def test_with_sglang_health_is_sglangs_readiness_without_it_liveness() -> None:
    """SGLang's prefill keeps an encoder in its rotation while /health is 200: with --sglang it is 503
    while the model loads and from the drain's start; without, it is the process's liveness."""
    from encode_server.api.http import HttpApi

    plain = HttpApi(Runtime(Settings(), Metrics()))
    assert asyncio.run(plain.health()).status_code == 200  # loading, still alive
    runtime = Runtime(settings_from(["--sglang"]), Metrics())
    sglang = HttpApi(runtime, health_is_readiness=True)
    assert asyncio.run(sglang.health()).status_code == 503  # loading
    runtime.draining = True
    assert asyncio.run(sglang.health()).status_code == 503
