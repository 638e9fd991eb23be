"""The CPU image, built with podman from this checkout and run as an operator runs it.

One build per run (layers cached under ~/.cache/encode-server/podman: a warm run rebuilds only the
layer with the code), then two containers on the host network, each on free ports and talking to a
redis-server this module starts on loopback:

- ``main``: ports set by flags (``--port``, with ``ENCODE_SERVER_PORT`` pointing elsewhere, so a
  probe that read only the environment would fail); ``--max-wait-ms`` long enough that requests are
  surely in flight when it gets SIGTERM (the last test here);
- ``locked``: the securityContext of deploy/k8s/deployment.yaml: read-only root filesystem with only
  the volumes the manifest mounts (/models, /tmp) writable, every capability dropped, no new
  privileges; its port set by ``ENCODE_SERVER_PORT`` only.

Every container is started under a name of this run, and removed by that name at the end (and a
container left by an earlier run that died is removed at the start); the build is a process group of
ours, ended by its ID if it overruns; no network configuration is created (host networking).
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from tests.container.podman import Podman, ensure_base_image, pip_build_options, require_container_tools
from tests.container.timings import TIMINGS
from tests.images import image_bytes
from tests.redis_procs import RedisProcess, start_redis
from tests.server import free_port

pytestmark = pytest.mark.timeout(3600)  # a cold build (debootstrap, torch, dependencies) on 2 shared cores

ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/encode-server-test:cpu"
LABEL = "encode-server-test.pid"
READY_WITHIN = 90.0  # seconds from `podman run` to /ready 200 (about 8 s on an idle 2-core host)
UID = 10001
BATCH_WAIT_MS = "5000"  # main's batch window: long enough that requests are surely in flight at SIGTERM


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class Container:
    podman: Podman
    name: str
    url: str
    started_at: float

    def logs(self) -> str:
        done = self.podman("logs", self.name, check=False)
        return done.stdout + done.stderr

    def inspect(self) -> dict:
        return json.loads(self.podman("container", "inspect", self.name).stdout)[0]

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name)] in " {")

    def wait_ready(self, within: float) -> float:
        """Seconds from `podman run` to /ready 200."""
        while time.monotonic() - self.started_at < within:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.TransportError:  # not listening yet, or gone
                if not self.inspect()["State"]["Running"]:
                    raise AssertionError(f"{self.name} exited:\n{self.logs()}") from None
            time.sleep(0.1)
        raise AssertionError(f"{self.name} not ready within {within} s:\n{self.logs()}")


def _remove_orphans(podman: Podman) -> None:
    """Containers an earlier run of this test left behind when it died (its PID is gone)."""
    listed = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "json", check=False)
    for c in json.loads(listed.stdout or "[]"):
        pid = int(c.get("Labels", {}).get(LABEL, "0"))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            podman("rm", "-f", "-t", "0", c["Id"], check=False)
        except PermissionError:
            pass


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    require_container_tools()
    interfaces = set(os.listdir("/sys/class/net"))
    podman = Podman.create()
    _remove_orphans(podman)
    yield podman
    assert set(os.listdir("/sys/class/net")) == interfaces, "a network interface was created"
    networks = [p.name for p in (podman.root / "networks").iterdir() if p.suffix in (".json", ".conflist")]
    assert not networks, f"a podman network was created: {networks}"


@pytest.fixture(scope="module")
def image(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The CPU image's ID: the stand-in base (cached), then a layered build of this checkout."""
    logs = tmp_path_factory.mktemp("container-build")
    base, base_seconds = ensure_base_image(podman, logs / "base.log")
    if base_seconds:
        TIMINGS["stand-in base image built (debootstrap + import)"] = f"{base_seconds:.0f} s"
    options, _cert = pip_build_options()
    iidfile = logs / "iid"
    started = time.monotonic()
    podman.build(
        [
            "--format", "docker", "--network", "host", "--layers", "--pull=never",
            "--build-arg", "VARIANT=cpu", "--build-arg", f"CPU_IMAGE={base}",
            *options, "--iidfile", str(iidfile), "--tag", TAG, "--file", str(ROOT / "Dockerfile"), str(ROOT),
        ],
        timeout=2700, log=logs / "build.log",
    )
    TIMINGS["image build"] = f"{time.monotonic() - started:.1f} s"
    image_id = iidfile.read_text().strip()
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image_id).stdout)
    TIMINGS["image size"] = f"{size / 1e9:.2f} GB"
    return image_id


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisProcess]:
    with start_redis() as server:
        yield server


@pytest.fixture(scope="module")
def containers(podman: Podman, image: str, own_redis: RedisProcess,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Container]]:
    """Both containers, started together (their start-ups overlap); removed by name at the end."""
    volumes = tmp_path_factory.mktemp("k8s-volumes")
    for d in ("models", "tmp"):  # emptyDir volumes owned by the pod's fsGroup
        (volumes / d).mkdir()
        os.chown(volumes / d, UID, UID)
    common = ["--detach", "--network", "host", "--label", f"{LABEL}={os.getpid()}",
              "--env", f"ENCODE_SERVER_REDIS_URL={own_redis.url}",
              "--env", "ENCODE_SERVER_CACHE_PREFIX=container-test"]
    main_port, locked_port = free_port(), free_port()
    specs = {
        "main": ([*common, "--env", f"ENCODE_SERVER_PORT={free_port()}"],  # overridden by --port below
                 ["--port", str(main_port), "--grpc-port", str(free_port()), "--max-wait-ms", BATCH_WAIT_MS,
                  "--drain-seconds", "20"], main_port),
        "locked": ([*common, "--env", f"ENCODE_SERVER_PORT={locked_port}",
                    "--env", f"ENCODE_SERVER_GRPC_PORT={free_port()}",
                    "--read-only", "--read-only-tmpfs=false",
                    "--volume", f"{volumes / 'models'}:/models", "--volume", f"{volumes / 'tmp'}:/tmp",
                    "--cap-drop", "ALL", "--security-opt", "no-new-privileges"], [], locked_port),
    }
    started: dict[str, Container] = {}
    try:
        for role, (options, args, port) in specs.items():
            name = f"encode-server-test-{os.getpid()}-{role}"
            started[role] = Container(podman, name, f"http://127.0.0.1:{port}", time.monotonic())
            podman("run", "--name", name, *options, image, *args, timeout=120)
        yield started
    finally:  # every name we asked for, even where `podman run` failed half-way
        for c in started.values():
            podman("rm", "--force", "--ignore", "--time", "0", c.name, check=False, timeout=60)


def test_image_runs_as_non_root_with_a_healthcheck_and_no_build_settings(podman: Podman, image: str) -> None:
    inspected = json.loads(podman("image", "inspect", image).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == f"{UID}:{UID}"
    # Kept only in the docker format (`--format docker`): podman's OCI default drops it.
    assert inspected["Healthcheck"]["Test"] == ["CMD", "/opt/venv/bin/python", "-m", "encode_server.healthcheck"]
    # Build arguments (indexes, wheelhouse paths) stay in the build stages: not in the config, nor the history.
    assert not [e for e in config["Env"] if e.startswith(("PIP_", "TORCH_INDEX"))], config["Env"]
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert "PIP_" not in history and "TORCH_INDEX" not in history and "/opt/build" not in history, history


def test_ready_within_bound(containers: dict[str, Container]) -> None:
    for role, c in containers.items():
        seconds = c.wait_ready(READY_WITHIN)
        TIMINGS[f"start-up to /ready ({role}, the two starting together)"] = f"{seconds:.1f} s"


def test_process_runs_as_the_non_root_user(containers: dict[str, Container]) -> None:
    for c in containers.values():
        pid = c.inspect()["State"]["Pid"]
        status = Path(f"/proc/{pid}/status").read_text()
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert uids == [str(UID)] * 4, (c.name, uids)


def test_encode_png_then_hash_only_hit_through_own_redis(containers: dict[str, Container],
                                                         own_redis: RedisProcess) -> None:
    main, locked = containers["main"], containers["locked"]
    main.wait_ready(READY_WITHIN)
    png = image_bytes("PNG", 40, 30, seed=1201)
    first = httpx.post(main.url + "/v1/encode", json={"items": [{"data": b64(png)}]}, timeout=60)
    assert first.status_code == 200, first.text
    item = first.json()["items"][0]
    assert (item["status"], item["source"]) == ("encoded", "encoder")
    assert item["shape"][0] > 0 and item["embedding"]
    again = httpx.post(main.url + "/v1/encode", json={"items": [{"hash": item["hash"]}]}, timeout=60)
    assert again.status_code == 200, again.text
    assert (again.json()["items"][0]["status"], again.json()["items"][0]["source"]) == ("hit", "local")
    assert again.json()["items"][0]["embedding"] == item["embedding"]

    # Written behind to the Redis this test started, on loopback: the other container finds it there.
    client: redis.Redis = own_redis.client()
    deadline = time.monotonic() + 20
    while not list(client.scan_iter(match=f"container-test:*{item['hash']}*")):
        assert time.monotonic() < deadline, "the embedding never reached Redis"
        time.sleep(0.1)
    locked.wait_ready(READY_WITHIN)
    shared = httpx.post(locked.url + "/v1/encode", json={"items": [{"hash": item["hash"]}]}, timeout=60)
    assert shared.status_code == 200, shared.text
    assert (shared.json()["items"][0]["status"], shared.json()["items"][0]["source"]) == ("hit", "redis")
    assert shared.json()["items"][0]["embedding"] == item["embedding"]
    assert main.metric("encode_server_redis_up") == 1.0


def test_read_only_root_with_the_k8s_volumes(containers: dict[str, Container], podman: Podman) -> None:
    locked = containers["locked"]
    locked.wait_ready(READY_WITHIN)
    host = locked.inspect()["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] and "no-new-privileges" in host["SecurityOpt"]
    refused = podman("exec", locked.name, "touch", "/opt/venv/written", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    # A fresh upload is decoded, preprocessed and encoded with only /models and /tmp writable.
    png = image_bytes("PNG", 33, 21, seed=1202)
    answer = httpx.post(locked.url + "/v1/encode", json={"items": [{"data": b64(png)}]}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["items"][0]["status"] == "encoded"
    records = [json.loads(line) for line in locked.logs().splitlines() if line.startswith("{")]
    assert records and not [r for r in records if r["level"] in ("error", "critical")], locked.logs()


def test_healthcheck_follows_the_port_however_it_was_set(containers: dict[str, Container], podman: Podman) -> None:
    # main: --port N while ENCODE_SERVER_PORT names a port nobody listens on; locked: the variable only.
    for c in containers.values():
        c.wait_ready(READY_WITHIN)
        done = podman("healthcheck", "run", c.name, check=False, timeout=60)
        assert done.returncode == 0 and "unhealthy" not in done.stdout, (c.name, done.stdout, done.stderr)
        probe = podman("exec", c.name, "/opt/venv/bin/python", "-m", "encode_server.healthcheck", check=False)
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert f"{c.url.rsplit(':', 1)[1]}/health" in probe.stdout


def test_sigterm_with_requests_in_flight_drains_and_exits_0(containers: dict[str, Container],
                                                            podman: Podman) -> None:
    """Last: it ends the main container."""
    main = containers["main"]
    main.wait_ready(READY_WITHIN)
    pngs = [image_bytes("PNG", 24, 24, seed=1210 + i) for i in range(3)]
    results: list[httpx.Response] = []
    answered_at: list[float] = []

    def send(data: bytes) -> None:
        results.append(httpx.post(main.url + "/v1/encode", json={"items": [{"data": b64(data)}]}, timeout=60))
        answered_at.append(time.monotonic())

    threads = [threading.Thread(target=send, args=(png,)) for png in pngs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    # A batch waits BATCH_WAIT_MS to fill: once all three are queued, they are in flight at SIGTERM.
    while main.metric("encode_server_queue_depth") < len(pngs):
        assert time.monotonic() < deadline, "the requests never reached the queue"
        time.sleep(0.02)
    signalled_at = time.monotonic()
    podman("kill", "--signal", "TERM", main.name)
    deadline = time.monotonic() + 10
    while httpx.get(main.url + "/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "/ready did not turn 503 on SIGTERM"
        time.sleep(0.05)
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * len(pngs), [r.text for r in results]
    assert all(r.json()["items"][0]["status"] == "encoded" for r in results)
    assert min(answered_at) > signalled_at, "a request was answered before SIGTERM: none was in flight"
    exit_code = podman("wait", main.name, timeout=60).stdout.strip()
    assert exit_code == "0", main.logs()
    assert "drained; shutting down" in main.logs()
