"""podman for the container test: its own configuration, storage and base image; no daemon, no bridge.

Everything podman keeps lives under one cache directory (``ENCODE_TEST_PODMAN_DIR``, default
``~/.cache/encode-server/podman``), outside the repository, so that a second run reuses the base
image and every layer that did not change; the layer holding the project's code is rebuilt
whenever the code changes (the build is an ordinary layered ``podman build``). What this machine
kind needs, in a ``containers.conf`` of our own (the host's is never touched):

- ``runc`` as the OCI runtime: crun refuses the hybrid cgroup v1/v2 layout these hosts have;
- container ulimits that fit under the host's hard limits (nofile 20000, nproc 32768): podman's
  default nofile is above them and every container would fail to start;
- host networking (``--network host``) for builds and runs: no bridge, no firewall rule, no network
  file is created (podman's network directory is pointed inside the cache directory anyway);
- no systemd: cgroupfs and a file events log.

Docker Hub is unreachable here, so :func:`ensure_base_image` builds a stand-in for
``python:3.11-slim-bookworm`` from Debian's archive (debootstrap ``--variant=minbase`` plus Debian's
python3, venv and pip), imports it with ``podman import`` and keeps it (and its tarball) cached.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.server import end_group

__all__ = [
    "BASE_IMAGE",
    "Podman",
    "base_image_tag",
    "ensure_base_image",
    "pip_build_options",
    "require_container_tools",
]

DEFAULT_DIR = Path.home() / ".cache" / "encode-server" / "podman"
DEBIAN_SUITE = "bookworm"  # python:3.11-slim-bookworm's Debian: its python3 is 3.11
DEBIAN_MIRROR = os.environ.get("ENCODE_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What python:3.11-slim has that minbase lacks: Python with venv and pip, CA certificates, and
# useradd/groupadd (passwd), which the Dockerfile's runtime stage calls.
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates", "passwd")
BASE_IMAGE = "localhost/encode-server-test-base"
INSTALL = "apt-get install -y podman runc debootstrap"


def require_container_tools() -> None:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not found; `make test` installs them, or run: {INSTALL}")


def container_ulimits() -> tuple[str, ...]:
    """nofile 20000 and nproc 32768, or the host's hard limit where that is lower: podman's own
    defaults (nofile 1048576) are above these hosts' limits, and runc then fails every start."""
    def fit(resource_id: int, wanted: int) -> int:
        hard = resource.getrlimit(resource_id)[1]
        return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)

    nofile, nproc = fit(resource.RLIMIT_NOFILE, 20000), fit(resource.RLIMIT_NPROC, 32768)
    return f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"


def base_image_tag() -> str:
    """The stand-in's tag names what it was built from: a change to the recipe builds a new one."""
    recipe = " ".join((DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES))
    return f"{BASE_IMAGE}:{DEBIAN_SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


@dataclass
class Podman:
    """``podman`` with this test's own configuration files, storage and run directory."""

    root: Path

    @classmethod
    def create(cls, root: Path | None = None) -> Podman:
        root = (root or Path(os.environ.get("ENCODE_TEST_PODMAN_DIR", DEFAULT_DIR))).expanduser().resolve()
        podman = cls(root)
        podman._write_config()
        return podman

    @property
    def run_dir(self) -> Path:
        # Runtime state (locks, container state) outside the cache, one per storage directory:
        # podman refuses a storage database whose run directory has changed.
        return Path("/run/encode-server-podman") / hashlib.sha256(str(self.root).encode()).hexdigest()[:12]

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CONTAINERS_CONF": str(self.root / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.root / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(self.root / "registries.conf"),
        }

    def _write_config(self) -> None:
        for d in (self.root, self.root / "networks", self.root / "volumes", self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
        ulimits = ", ".join(f'"{u}"' for u in container_ulimits())
        files = {
            "containers.conf": f"""\
# encode-server's container test (tests/container/podman.py); the host's podman config is untouched.
[containers]
default_ulimits = [{ulimits}]
netns = "host"
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{self.run_dir}/events.log"
tmp_dir = "{self.run_dir}/libpod"
volume_path = "{self.root}/volumes"

[network]
network_config_dir = "{self.root}/networks"
""",
            "storage.conf": f"""\
[storage]
driver = "overlay"
graphroot = "{self.root}/storage"
runroot = "{self.run_dir}/storage"
""",
            # Only local images: a name that is not there is an error, never a pull from a registry.
            "registries.conf": "unqualified-search-registries = []\nshort-name-mode = \"disabled\"\n",
        }
        for name, text in files.items():
            path = self.root / name
            if not path.exists() or path.read_text() != text:
                path.write_text(text)

    def command(self, *args: str) -> list[str]:
        return ["podman", *args]

    def __call__(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.command(*args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {shlex.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def build(self, args: Sequence[str], *, timeout: float, log: Path) -> None:
        """``podman build ARGS``, one at a time per storage directory (concurrent test runs queue
        here rather than fight over two cores). Should it overrun or be interrupted, everything it
        started is ended by ID: its process group, the runc containers of its RUN steps (found by
        their bundles, which live in a temporary directory of this build) and its working
        containers (the ones that appeared during this build; no other build can run meanwhile)."""
        with _locked(self.root / "build.lock"):
            before = self._working_containers()
            tmp = Path(tempfile.mkdtemp(prefix="build-", dir=self.run_dir))
            try:
                self._run_logged(["build", *args], timeout=timeout, log=log, tmpdir=tmp)
            except BaseException:
                self._end_build_leftovers(before, tmp)
                raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    def _run_logged(self, args: Sequence[str], *, timeout: float, log: Path, tmpdir: Path) -> None:
        with log.open("ab") as out:
            proc = subprocess.Popen(self.command(*args), env={**self.env, "TMPDIR": str(tmpdir)}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _end_group(proc)
                raise RuntimeError(f"podman {args[0]} did not finish within {timeout} s; see {log}") from None
            except BaseException:  # interrupted (Ctrl-C, pytest-timeout): the build must not outlive us
                _end_group(proc)
                raise
        if code != 0:
            tail = log.read_text(errors="replace")[-6000:]
            raise RuntimeError(f"podman {shlex.join(args)} exited {code}:\n{tail}")

    def _working_containers(self) -> set[str]:
        listed = self("ps", "--all", "--external", "--format", "{{.ID}}", check=False)
        return set(listed.stdout.split())

    def _end_build_leftovers(self, before: set[str], tmpdir: Path) -> None:
        listed = subprocess.run(["runc", "list", "--format", "json"], capture_output=True, text=True, timeout=30)
        for c in json.loads(listed.stdout or "null") or []:
            if str(c.get("bundle", "")).startswith(str(tmpdir)):
                subprocess.run(["runc", "kill", c["id"], "KILL"], capture_output=True, timeout=30)
                subprocess.run(["runc", "delete", "--force", c["id"]], capture_output=True, timeout=30)
        for container in self._working_containers() - before:
            self("rm", "--force", container, check=False)

    def image_exists(self, ref: str) -> bool:
        return self("image", "exists", ref, check=False).returncode == 0


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """The process group we started ended, with 60 s before SIGKILL. (What its RUN steps started is
    not in that group: see ``Podman.build``.)"""
    end_group(proc, grace_s=60)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder of the base image at a time, across concurrent test runs."""
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_base_image(podman: Podman, log: Path) -> tuple[str, float]:
    """The stand-in base image's tag, and the seconds spent making it (0 when it was cached)."""
    tag = base_image_tag()
    started = time.monotonic()
    with _locked(podman.root / "base.lock"):
        if podman.image_exists(tag):
            return tag, 0.0
        tarball = podman.root / "base" / (tag.rsplit(":", 1)[1] + ".tar")
        if not tarball.exists():
            _debootstrap(tarball, log)
        podman(
            "import",
            "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change", "ENV LANG=C.UTF-8",
            "--change", 'CMD ["python3"]',
            str(tarball), tag,
            timeout=600,
        )
    return tag, time.monotonic() - started


def _debootstrap(tarball: Path, log: Path) -> None:
    tarball.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=tarball.parent))
    try:
        rootfs = work / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
               DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR]
        with log.open("ab") as out:
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=1800)
        # As in Debian's slim images: no package lists or downloaded .debs in the image.
        for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for entry in (rootfs / leftover).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."],
                       check=True, timeout=600)
        partial.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pip_config() -> dict[str, str]:
    """``pip config list`` as {key: value}, the most specific scope last (so it wins)."""
    done = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60)
    values: dict[str, str] = {}
    for line in done.stdout.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        key = name.split(".", 1)[-1]
        values[key] = raw.strip().strip("'\"")
    return values


def pip_build_options() -> tuple[list[str], str | None]:
    """This host's pip configuration as ``podman build`` options: the Dockerfile's ``PIP_*`` build
    arguments, a read-only bind mount for every local directory they name, and the CA bundle as
    the ``pip-ca`` secret. Also the path of that bundle (None where pip has none configured).

    Nothing here is written into the Dockerfile: a build on another host passes its own.
    """
    config = _pip_config()
    options: list[str] = []
    mounts: set[Path] = set()

    def local(entry: str, parent: bool) -> None:
        path = Path(entry.removeprefix("file://")) if entry.startswith(("file://", "/")) else None
        if path is not None and path.exists():
            # An index directory (.../simple) links to its files next to it (../../files).
            mounts.add(path.parent if parent else path)

    for key, arg, parent in (
        ("find-links", "PIP_FIND_LINKS", False),
        ("index-url", "PIP_INDEX_URL", True),
        ("extra-index-url", "PIP_EXTRA_INDEX_URL", True),
        ("trusted-host", "PIP_TRUSTED_HOST", False),
    ):
        if key in config:
            options += ["--build-arg", f"{arg}={config[key]}"]
            if key != "trusted-host":
                for entry in config[key].split():
                    local(entry, parent)
    for path in sorted(mounts):
        options += ["--volume", f"{path}:{path}:ro"]
    cert = config.get("cert") or None
    if cert is not None and Path(cert).is_file():
        options += ["--secret", f"id=pip-ca,src={cert}"]
    # torch from the host's index (PyPI unless configured) plus the find-links wheelhouse, where the
    # CPU wheel lies: download.pytorch.org is not reachable from these machines.
    options += ["--build-arg", f"TORCH_INDEX_URL={config.get('index-url', 'https://pypi.org/simple')}"]
    return options, cert
