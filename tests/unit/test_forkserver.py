"""Which processes one fork server may fork (tests/forkserver.py): those whose environment differs
from its own only in what no library reads at import; any other gets a fork server of its own."""

from __future__ import annotations

from tests.forkserver import import_environment

BASE = {"PATH": "/usr/bin", "HF_HUB_OFFLINE": "1", "ENCODE_SERVER_WARMUP": "quick"}


def test_servers_whose_environments_differ_only_in_their_own_settings_share_a_fork_server() -> None:
    env = {**BASE, "ENCODE_SERVER_WARMUP": "full", "ENCODE_SERVER_API_KEYS": "a:b", "PYTEST_CURRENT_TEST": "t (call)"}
    assert import_environment(env) == import_environment(BASE) == (("HF_HUB_OFFLINE", "1"), ("PATH", "/usr/bin"))
    without = {k: v for k, v in BASE.items() if k != "ENCODE_SERVER_WARMUP"}
    assert import_environment(without) == import_environment(BASE)


def test_a_variable_a_library_or_the_loader_reads_at_start_set_otherwise_gets_its_own_fork_server() -> None:
    for changed in ({**BASE, "OMP_NUM_THREADS": "1"}, {**BASE, "HF_HUB_OFFLINE": "0"},
                    {**BASE, "LD_LIBRARY_PATH": "/opt/lib"}, {k: v for k, v in BASE.items() if k != "PATH"}):
        assert import_environment(changed) != import_environment(BASE), changed
