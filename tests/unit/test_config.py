from __future__ import annotations

import pytest

from encode_server.config import Settings, build_parser, settings_from


def test_defaults_then_environment_then_flags() -> None:
    assert settings_from([], {}) == Settings()
    env = {"ENCODE_SERVER_MAX_BATCH_SIZE": "7", "ENCODE_SERVER_MODEL": "/models/x", "ENCODE_SERVER_CACHE_MB": "1.5"}
    s = settings_from([], env)
    assert (s.max_batch_size, s.model, s.cache_bytes) == (7, "/models/x", int(1.5 * 1024 * 1024))
    s = settings_from(["--max-batch-size", "9", "--max-wait-ms", "2.5"], env)
    assert (s.max_batch_size, s.max_wait_ms, s.model) == (9, 2.5, "/models/x")


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Settings().port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--max-batch-size", "0"], {}),
        (["--device-typo", "cpu"], {}),
        (["--dtype", "int8"], {}),
        ([], {"ENCODE_SERVER_DTYPE": "int8"}),
        ([], {"ENCODE_SERVER_MAX_ITEMS": "many"}),
    ],
)
def test_bad_settings_exit_with_a_message(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(SystemExit):
        settings_from(argv, env)


def test_the_memory_budget_flag_env_and_its_floor() -> None:
    assert settings_from([]).max_inflight_bytes == 2048 * 1024 * 1024
    assert settings_from([], {"ENCODE_SERVER_MAX_INFLIGHT_MB": "512"}).max_inflight_bytes == 512 * 1024 * 1024
    assert settings_from(["--max-inflight-mb", "0"]).max_inflight_bytes is None  # 0: no bound
    # One largest request with its copies must fit, or it could never be served: refused at start.
    small = ["--max-request-bytes", str(32 * 1024 * 1024)]
    assert settings_from([*small, "--max-inflight-mb", "129"]).max_inflight_bytes == 129 * 1024 * 1024
    for bad in (["--max-inflight-mb", "-1"], [*small, "--max-inflight-mb", "128"], ["--max-inflight-mb", "200"]):
        with pytest.raises(SystemExit):
            settings_from(bad)


def test_boolean_flags_are_switches_with_a_negation_and_keep_their_environment_variable() -> None:
    help_text = build_parser().format_help()
    assert "[REDIS_CLUSTER]" not in help_text and "[TENANT_ISOLATION]" not in help_text
    assert "--redis-cluster, --no-redis-cluster" in help_text
    assert settings_from(["--redis-cluster"], {}).redis_cluster is True
    assert settings_from([], {"ENCODE_SERVER_REDIS_CLUSTER": "true"}).redis_cluster is True
    assert settings_from(["--no-redis-cluster"], {"ENCODE_SERVER_REDIS_CLUSTER": "yes"}).redis_cluster is False
    assert settings_from([], {}).redis_cluster is False
    with pytest.raises(SystemExit):
        settings_from([], {"ENCODE_SERVER_REDIS_CLUSTER": "maybe"})
