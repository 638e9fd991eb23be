"""The image's HEALTHCHECK probe finds the server's port however it was set (the container test runs
it inside the real image; here, every way of setting it, against a fake /proc and a real server)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from encode_server.config import settings_from
from encode_server.healthcheck import find_server, health_url, main, server_args
from tests.server import start_server


def fake_proc(root: Path, processes: dict[int, tuple[list[str], dict[str, str]]]) -> Path:
    for pid, (argv, environ) in processes.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    (root / "self").mkdir(exist_ok=True)  # not a PID: ignored
    return root


IMAGE_ENV = {"PATH": "/opt/venv/bin:/usr/bin", "ENCODE_SERVER_HOST": "0.0.0.0", "ENCODE_SERVER_PORT": "8000"}
SCRIPT = ["/opt/venv/bin/python", "/opt/venv/bin/encode-server"]  # the console script through its shebang


@pytest.mark.parametrize(
    ("argv", "environ", "url"),
    [
        (SCRIPT, IMAGE_ENV, "http://127.0.0.1:8000/health"),
        ([*SCRIPT, "--port", "9100"], IMAGE_ENV, "http://127.0.0.1:9100/health"),
        ([*SCRIPT, "--model", "builtin:tiny", "--port=9101"], IMAGE_ENV, "http://127.0.0.1:9101/health"),
        (SCRIPT, {**IMAGE_ENV, "ENCODE_SERVER_PORT": "9102"}, "http://127.0.0.1:9102/health"),
        (["encode-server", "--host", "10.1.2.3", "--port", "9103"], {}, "http://10.1.2.3:9103/health"),
        (["python3", "-m", "encode_server", "--host", "::"], {"ENCODE_SERVER_PORT": "9104"}, "http://[::1]:9104/health"),
        (["encode-server"], {}, "http://127.0.0.1:8000/health"),
    ],
)
def test_the_probe_resolves_what_the_server_resolved(argv: list[str], environ: dict[str, str], url: str,
                                                     tmp_path: Path) -> None:
    found = find_server(fake_proc(tmp_path, {1: (argv, environ)}))
    assert found is not None
    args, env = found
    assert health_url(settings_from(args, env)) == url


def test_behind_an_init_process_the_server_is_found_and_other_processes_ignored(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {
        1: (["/run/podman-init", "--", "encode-server", "--port", "9200"], {}),
        7: (["encode-server", "--port", "9200"], IMAGE_ENV),
        9: (["/opt/venv/bin/python", "-m", "encode_server.healthcheck"], IMAGE_ENV),
    })
    assert server_args(["/run/podman-init", "--", "encode-server"]) is None
    assert server_args(["/opt/venv/bin/python", "-m", "encode_server.healthcheck"]) is None
    assert find_server(proc) == (["--port", "9200"], IMAGE_ENV)


def test_no_server_or_bad_settings_is_unhealthy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([], proc=fake_proc(tmp_path / "a", {1: (["sleep", "1"], {})})) == 1
    assert "no encode-server process" in capsys.readouterr().out
    assert main([], proc=fake_proc(tmp_path / "b", {1: (["encode-server", "--port", "x"], {})})) == 1
    assert "cannot read the server's settings" in capsys.readouterr().out


def test_healthy_against_a_real_server_then_unhealthy_once_it_stopped(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    server = start_server(log_dir=tmp_path, fresh=True)  # its /proc/PID/cmdline and environ are read
    try:
        pid = server.proc.pid
        real = Path(f"/proc/{pid}")
        environ = dict(e.split("=", 1) for e in (real / "environ").read_bytes().decode().split("\0") if "=" in e)
        argv = [a for a in (real / "cmdline").read_bytes().decode().split("\0") if a]
        proc = fake_proc(tmp_path / "proc", {1: (argv, environ)})
        assert main([], proc=proc) == 0
        assert f"{server.url}/health answered 200" in capsys.readouterr().out
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.stop()
    assert main([], proc=proc, timeout=2) == 1
    assert "unhealthy" in capsys.readouterr().out
