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


def test_a_value_of_the_wrong_type_names_its_flag_and_type_not_a_converter_repr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from(["--port", "abc"])
    assert exited.value.code == 2  # argparse's: a value of the wrong type
    err = capsys.readouterr().err
    assert "argument --port: invalid int value: 'abc'" in err
    assert "functools" not in err and "partial" not in err
    with pytest.raises(SystemExit, match=r"^ENCODE_SERVER_PORT='abc': expected an integer$"):
        settings_from([], {"ENCODE_SERVER_PORT": "abc"})
    with pytest.raises(SystemExit, match=r"^ENCODE_SERVER_CACHE_MB='lots': expected a number$"):
        settings_from([], {"ENCODE_SERVER_CACHE_MB": "lots"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache-mb", "-1"], "--cache-mb must be >= 0 (0 turns the local cache off), got -1"),
        (["--max-wait-ms", "-1"], "--max-wait-ms must be >= 0, got -1"),
        (["--request-timeout", "0"], "--request-timeout must be positive, got 0"),
        (["--redis-ttl", "-5"], "--redis-ttl must be >= 0 (0: no expiry), got -5"),
        (["--redis-timeout-ms", "0"], "--redis-timeout-ms must be positive, got 0"),
        (["--redis-write-queue", "0"], "--redis-write-queue must be positive, got 0"),
    ],
)
def test_a_value_that_cannot_work_names_only_the_flag_at_fault(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from(argv)
    assert str(exited.value.code) == message


def test_help_shows_whole_defaults_as_the_flag_table_does() -> None:
    help_text = " ".join(build_parser().format_help().split())  # argparse wraps lines
    assert "(default: 1024)" in help_text and "(default: 1024.0)" not in help_text
    assert "(default: 2048)" in help_text
    assert "(default: 5)" in help_text  # --max-wait-ms 5.0
    assert "(default: false)" in help_text  # a switch, as its environment variable spells it


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--redis-url", "localhost:6379"], {}, "--redis-url must start with one of redis://, rediss://, unix://"),
        ([], {"ENCODE_SERVER_REDIS_URL": "127.0.0.1:6379"}, "--redis-url must start with one of"),
        (["--redis-url", "http://localhost:6379"], {}, "--redis-url must start with one of"),
        (["--redis-url", "redis://localhost:port"], {}, "--redis-url: Port could not be cast to integer"),
        (["--redis-url", "redis://localhost:70000"], {}, "--redis-url: Port out of range"),
        (["--redis-url", "unix://"], {}, "--redis-url: a unix:// URL needs the socket's path"),
        (["--redis-url", "unix:///run/redis.sock", "--redis-cluster"], {}, "--redis-cluster needs a redis://"),
    ],
)
def test_a_redis_url_that_cannot_work_is_refused_when_the_flags_are_parsed(
    argv: list[str], env: dict[str, str], says: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from(argv, env)
    message = str(exited.value.code)
    assert message.startswith(says) and "\n" not in message


def test_a_redis_url_message_never_repeats_the_url_it_may_hold_a_password() -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from(["--redis-url", "secret-password@localhost:6379"])
    assert "secret-password" not in str(exited.value.code)


@pytest.mark.parametrize(
    "url",
    ["redis://localhost:6379/0", "REDIS://localhost", "rediss://:pw@redis:6380/0", "unix:///run/redis.sock",
     "redis+cluster://redis-0:6379", "rediss+cluster://redis-0"],
)
def test_every_documented_redis_url_form_is_taken(url: str) -> None:
    assert settings_from(["--redis-url", url]).redis_url == url


def test_help_lists_every_redis_scheme_taken_unix_included() -> None:
    help_text = " ".join(build_parser().format_help().split())
    for scheme in ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://"):
        assert scheme in help_text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["--device", "cuda:x"], "--device must be auto, cpu, cuda or cuda:N, got 'cuda:x'"),
        (["--port", "70000"], "--port must be a port number, got 70000"),
        (["--max-header-bytes", "0"], "--max-header-bytes must be positive, got 0"),
        # Each of these passed the checks, then failed later: at every request, or when a door started.
        (["--max-image-pixels", "0"], "--max-image-pixels must be positive, got 0"),
        (["--max-inflight-mb", "nan"], "--max-inflight-mb must be a finite number, got nan"),
        (["--request-timeout", "nan"], "--request-timeout must be a finite number, got nan"),
        (["--cache-mb", "inf"], "--cache-mb must be a finite number, got inf"),
        (["--model", ""], "--model must name a model: a hub id, a local directory, or builtin:tiny"),
        (["--host", ""], "--host must be an address (0.0.0.0 or :: for every interface)"),
        (["--export-dir", " "], "--export-dir must name a directory (unset it to export nothing)"),
        (["--max-header-bytes", str(2**31)], f"--max-header-bytes must be at most {2**31 - 1} (gRPC's limit), got "
         f"{2**31}"),
        (["--max-request-bytes", str(2**31), "--max-inflight-mb", "0"], "--max-request-bytes must be at most "
         f"{2**31 - 1 - 65536} (gRPC's message limit less its framing), got {2**31}"),
        (["--redis-timeout-ms", "1e300"], "--redis-timeout-ms must be at most 3600000 (an hour), got 1e+300"),
        (["--redis-ttl", str(2**40)], f"--redis-ttl must be at most {2**31 - 1} s (68 years; 0: no expiry), got "
         f"{2**40}"),
    ],
)
def test_a_value_that_passed_the_checks_then_failed_later_is_refused_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_from(argv)
    assert str(exited.value.code) == message


def test_an_empty_redis_url_is_unset_as_a_compose_files_default_gives_it() -> None:
    assert settings_from([], {"ENCODE_SERVER_REDIS_URL": ""}).redis_url == ""


def test_the_header_limit_is_64_kib_a_flag_and_a_variable() -> None:
    assert settings_from([]).max_header_bytes == 64 * 1024
    assert settings_from([], {"ENCODE_SERVER_MAX_HEADER_BYTES": "8192"}).max_header_bytes == 8192
    assert settings_from(["--max-header-bytes", "4096"], {"ENCODE_SERVER_MAX_HEADER_BYTES": "8192"}).max_header_bytes \
        == 4096
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert settings_from(["--device", device]).device == device
