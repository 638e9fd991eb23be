"""Schemathesis against the server's own /openapi.json: every route, every documented body kind
(JSON, multipart, raw), valid and invalid inputs, with a bounded number of examples and a fixed
seed, on a server without API keys and on one with them. No 5xx; every response's status,
content type and body are the ones the document promises."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.calls import server_errors
from tests.robust.conftest import ROBUST_ARGS
from tests.server import ServerProcess, start_server

pytestmark = pytest.mark.integration

API_KEY = "fuzz-secret-key"
EXAMPLES = 25  # per operation and mode; fixed seed (deterministic) so a failure reproduces
CHECKS = [
    not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def keyed_server(robust_logs) -> Iterator[ServerProcess]:
    server = start_server(*ROBUST_ARGS, "--api-key", API_KEY, log_dir=robust_logs)
    yield server
    assert server_errors(server) == 0, server.log()[-4000:]
    assert server.stop() == 0, server.log()


@pytest.fixture(params=["open", "keyed"])
def fuzz_server(request: pytest.FixtureRequest) -> tuple[ServerProcess, dict[str, str]]:
    """The shared server without keys, and one with an API key (requests then carry it)."""
    if request.param == "keyed":
        return request.getfixturevalue("keyed_server"), {"Authorization": f"Bearer {API_KEY}"}
    return request.getfixturevalue("robust_server"), {}


# Invalid data must be refused with a documented 4xx: 413 is one (too many items is checked before
# the item shapes, as on gRPC); a 5xx never is.
CONFIG = SchemathesisConfig.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": [400, 401, 404, 405, 409, 413, 415, 422]}}}
)


def test_every_route_keeps_the_documented_contract(fuzz_server: tuple[ServerProcess, dict[str, str]]) -> None:
    """Each operation x {positive, negative} data, driven by hypothesis directly (schemathesis's
    pytest plugin does not run on pytest 9: it reads a private node attribute)."""
    server, headers = fuzz_server
    assert server_errors(server) == 0
    api = schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)
    operations = [result.ok() for result in api.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert {"POST /v1/encode", "POST /v1/lookup", "POST /v1/tokens", "GET /v1/model", "GET /ready"} <= set(labels)
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and op.method.upper() == "GET":
                continue  # no parameters and no body: nothing to make invalid

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case: schemathesis.Case) -> None:
                case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=30)

            try:
                run()
            except Exception as exc:
                raise AssertionError(f"{op.label} ({mode.value}): {exc}") from exc
    assert server_errors(server) == 0, server.log()[-4000:]


def test_without_the_key_every_v1_route_is_a_documented_401(keyed_server: ServerProcess) -> None:
    doc = httpx.get(keyed_server.url + "/openapi.json").json()
    for path, ops in doc["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, op in ops.items():
            assert "401" in op["responses"], (method, path)
            r = httpx.request(method, keyed_server.url + path, json={"items": [{"hash": "0" * 64}]})
            assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized", (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
