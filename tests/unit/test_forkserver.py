"""The fork server's rule for which servers it may fork (tests/forkserver.py): only those whose
environment differs from its own in what no library reads at import."""

from __future__ import annotations

from tests.forkserver import forkable

BASE = {"PATH": "/usr/bin", "HF_HUB_OFFLINE": "1", "ENCODE_SERVER_WARMUP": "quick"}


def test_a_server_whose_environment_differs_only_in_its_own_settings_is_forked() -> None:
    env = {**BASE, "ENCODE_SERVER_WARMUP": "full", "ENCODE_SERVER_API_KEYS": "a:b", "PYTEST_CURRENT_TEST": "t (call)"}
    assert forkable(env, BASE) is None
    assert forkable({k: v for k, v in BASE.items() if k != "ENCODE_SERVER_WARMUP"}, BASE) is None


def test_a_variable_a_library_may_read_at_import_set_otherwise_starts_a_fresh_interpreter() -> None:
    assert forkable({**BASE, "OMP_NUM_THREADS": "1"}, BASE) == "environment differs: OMP_NUM_THREADS"
    assert forkable({**BASE, "HF_HUB_OFFLINE": "0", "MALLOC_ARENA_MAX": "2"}, BASE) == (
        "environment differs: HF_HUB_OFFLINE, MALLOC_ARENA_MAX")
    assert forkable({k: v for k, v in BASE.items() if k != "PATH"}, BASE) == "environment differs: PATH"
