"""The wheel set the lent GPU machine lacks, derived, downloaded and checked (``make gpu-wheels``).

The lent H200 reaches no package registry; its ``python3`` (3.12) has torch, torchvision,
transformers and about 200 other packages (``bench/gpu/device-packages.txt``). What the server and
the client need beyond those travels in ``.gpu/`` (ignored by git; the ``run`` tool's ``carry``
takes it, 64 MiB at most) and is installed there by ``bench/gpu/check.sh`` with
``pip install --no-index --no-deps --target``.

The set is derived, not listed by hand: from the two ``pyproject.toml`` files' requirements, walked
through each carried package's own ``Requires-Dist`` (markers evaluated for CPython 3.12 on x86_64
Linux, extras followed), stopping at a requirement the device meets. The device meets one when the
package is in its list and its known version satisfies the specifier (a known version that does
not is carried); an unknown version is trusted, except for ``CARRY_ANYWAY``. Versions are the ones
installed in the environment this runs in (the project's ``.venv``: the versions its tests passed
with), downloaded as cp312 manylinux wheels. ``check`` then reads each downloaded wheel's own
METADATA and fails on any requirement neither the set nor the device meets, so that a missing
wheel fails here, not on the device.

Subcommands: ``derive`` (print the set), ``download`` (fetch into ``.gpu/``, idempotent: what is
there and matches is kept; prints the folder's size), ``check`` (the downloaded set against the
device), ``verify-env`` (run on the device: every requirement met by what python3 sees).
"""

from __future__ import annotations

import argparse
import email.parser
import fcntl
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PACKAGES = ROOT / "bench" / "gpu" / "device-packages.txt"
GPU_DIR = ROOT / ".gpu"
MANIFEST = "MANIFEST.json"
# The project's own packages: built from their trees, never downloaded.
PROJECTS = {"encode-server": ROOT, "encode-client": ROOT / "clients" / "python"}
# On the device, versions unknown, and an older one fails at import: the generated gRPC code checks
# grpcio and protobuf against the versions it was generated with (make proto). Ours travel and
# come first on PYTHONPATH.
CARRY_ANYWAY = frozenset({"grpcio", "protobuf"})
# The device's interpreter, as markers see it (KINDS.md: Python 3.12.3 on x86_64 Linux).
TARGET = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "platform_release": "",
    "platform_version": "",
}
# Tags a wheel may carry to install there (and in the rehearsal here, glibc 2.36): cp312 or abi3 or
# pure, manylinux up to glibc 2.35 (Ubuntu 22.04 and later, Debian 12).
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 36)
]
# The device's packages the GPU path, the check and tests/gpu use beyond the server's requirements.
REHEARSAL_EXTRA = ("torchvision", "packaging", "pytest", "pytest-timeout")
# Carried for the check itself, not the server: py-spy samples the server's GIL (bench/ceiling.py).
CHECK_EXTRA = ("py-spy",)
SIZE_LIMIT = 64 * 2**20  # the run tool's carry limit, the whole working tree included
DEBS = ("redis-server", "redis-tools", "libjemalloc2", "liblzf1", "libatomic1")


def _requirements_of(project: Path) -> list[str]:
    data = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    return list(data.get("dependencies", []))


def device_packages(path: Path = DEVICE_PACKAGES) -> dict[str, Version | None]:
    """Name -> version (None: there, version unknown), from the device's package list."""
    out: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version) if version else None
    return out


def _applies(req: Requirement, extras: Iterable[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET, "extra": extra}) for extra in ("", *extras))


def met_by_device(req: Requirement, device: dict[str, Version | None]) -> bool:
    name = canonicalize_name(req.name)
    if name not in device or name in CARRY_ANYWAY:
        return False
    version = device[name]
    return version is None or req.specifier.contains(version, prereleases=True)


@dataclass(frozen=True)
class Carried:
    name: str  # canonical
    version: str
    required_by: str


def derive(device: dict[str, Version | None]) -> list[Carried]:
    """The packages to carry, at the versions installed here, in a stable order.

    Raises ``SystemExit`` naming a requirement that is neither met by the device nor installed
    here at a version that satisfies it (then this environment cannot tell what to carry)."""
    carried: dict[str, Carried] = {}
    queue: list[tuple[Requirement, str]] = [
        (Requirement(r), project) for project, path in PROJECTS.items() for r in _requirements_of(path)
    ] + [(Requirement(name), "bench/gpu_check.py") for name in CHECK_EXTRA]
    walked: set[tuple[str, frozenset[str]]] = set()
    while queue:
        req, parent = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in PROJECTS or met_by_device(req, device):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{req} (needed by {parent}) is not on the device and not installed here") from None
        if not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"{req} (needed by {parent}): {dist.version} is installed here")
        carried.setdefault(name, Carried(name, dist.version, parent))
        key = (name, frozenset(req.extras))
        if key in walked:
            continue
        walked.add(key)
        for raw in dist.requires or []:
            sub = Requirement(raw)
            if _applies(sub, req.extras):
                queue.append((sub, name))
    return sorted(carried.values(), key=lambda c: c.name)


def device_needs(device: dict[str, Version | None]) -> list[str]:
    """What the server takes from the device's image, as requirement lines (its known versions
    pinned): the rehearsal installs these, and nothing else, as its stand-in for that image."""
    names: dict[str, str] = {name: "" for name in REHEARSAL_EXTRA}
    queue = [(Requirement(r), project) for project, path in PROJECTS.items() for r in _requirements_of(path)]
    seen: set[str] = set()
    while queue:
        req, _ = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        if name in PROJECTS:
            continue
        if met_by_device(req, device) or name in CARRY_ANYWAY:
            names[name] = ""
            continue
        for raw in metadata.distribution(name).requires or []:
            sub = Requirement(raw)
            if _applies(sub, req.extras):
                queue.append((sub, name))
    return [f"{n}=={device[n]}" if device.get(n) else n for n in sorted(names)]


# -- the downloaded set ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: Version
    requires: list[Requirement]

    @classmethod
    def read(cls, path: Path) -> Wheel:
        name, version, _, tags = parse_wheel_filename(path.name)
        if not any(_installable(t) for t in tags):
            raise SystemExit(f"{path.name}: none of its tags installs on CPython 3.12 on x86_64 Linux")
        with zipfile.ZipFile(path) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            message = email.parser.BytesParser().parsebytes(z.read(meta_name), headersonly=True)
        requires = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
        return cls(path, canonicalize_name(name), version, requires)


def _installable(tag: Tag) -> bool:
    return tag in _SUPPORTED


_SUPPORTED = frozenset(
    [*cpython_tags((3, 12), abis=["cp312"], platforms=PLATFORMS),
     *compatible_tags((3, 12), interpreter="cp312", platforms=PLATFORMS)]
)


def wheels_in(folder: Path) -> list[Wheel]:
    return [Wheel.read(p) for p in sorted(folder.glob("*.whl"))]


def check(folder: Path, device: dict[str, Version | None]) -> list[str]:
    """Problems with the set in ``folder``: a name twice, or a requirement (of a wheel, for the
    extras the project asks of it) met neither by another wheel there nor by the device."""
    wheels = wheels_in(folder)
    problems: list[str] = []
    by_name: dict[str, Wheel] = {}
    for wheel in wheels:
        if wheel.name in by_name:
            problems.append(f"two versions of {wheel.name}: {by_name[wheel.name].path.name}, {wheel.path.name}")
        by_name[wheel.name] = wheel
    for project in PROJECTS:
        if project not in by_name:
            problems.append(f"no wheel of {project}")
    extras = _extras_asked(wheels)
    for wheel in wheels:
        for req in wheel.requires:
            if not _applies(req, extras.get(wheel.name, ())):
                continue
            name = canonicalize_name(req.name)
            have = by_name.get(name)
            if have is not None and req.specifier.contains(have.version, prereleases=True):
                continue
            if have is None and met_by_device(req, device):
                continue
            found = f"{have.version} is in the set" if have else "not in the set, not on the device"
            problems.append(f"{wheel.name} {wheel.version} needs {req}: {found}")
    return problems


def _extras_asked(wheels: list[Wheel]) -> dict[str, set[str]]:
    """The extras some wheel of the set requires of another (``uvicorn[standard]``)."""
    asked: dict[str, set[str]] = {}
    for wheel in wheels:
        for req in wheel.requires:
            if req.extras and _applies(req, ()):
                asked.setdefault(canonicalize_name(req.name), set()).update(req.extras)
    return asked


# -- downloading ----------------------------------------------------------------------------------


def _pip_download(specs: list[str], dest: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
        "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *platforms,
        "--dest", str(dest), *specs,
    ]
    subprocess.run(cmd, check=True)


def _build_project_wheels(dest: Path) -> None:
    """The project's two packages, built from the tree (a few seconds: no isolation, no deps); one
    build at a time, since every build uses the tree's build/ folders (``make dist`` runs this too,
    and the tests run both while ``make test``'s other lane may)."""
    dest.mkdir(parents=True, exist_ok=True)
    with (ROOT / ".venv" / ".wheel-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for wheel in dest.glob("encode_*.whl"):
            wheel.unlink()
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
               str(dest), *(str(p) for p in PROJECTS.values())]
        subprocess.run(cmd, check=True, cwd=ROOT)
        for build in (ROOT / "build", ROOT / "clients" / "python" / "build"):
            shutil.rmtree(build, ignore_errors=True)


def _download_debs(dest: Path) -> None:
    """redis-server and the libraries it needs that a CUDA image may lack (libc, libssl and
    libsystemd are taken from the device)."""
    missing = [d for d in DEBS if not any(dest.glob(f"{d}_*.deb"))]
    if not missing:
        return
    dest.mkdir(parents=True, exist_ok=True)
    cmd = ["apt-get", "download", "-q", *missing]
    if subprocess.run(cmd, cwd=dest, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(cmd, cwd=dest, check=True, capture_output=True)


def download(root: Path, device: dict[str, Version | None]) -> None:
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    carried = derive(device)
    wanted = {c.name: c.version for c in carried}
    manifest_path = wheels / MANIFEST
    before = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    present = {w.name: w for w in wheels_in(wheels) if w.name not in PROJECTS}
    for name, wheel in present.items():  # a stale or unwanted version goes
        if wanted.get(name) != str(wheel.version) or before.get(name) != wanted.get(name):
            wheel.path.unlink()
    todo = [f"{c.name}=={c.version}" for c in carried if c.name not in present or before.get(c.name) != c.version]
    todo = [spec for spec in todo if not _have(wheels, spec)]
    if todo:
        print(f"downloading {len(todo)} wheels: {' '.join(todo)}", flush=True)
        _pip_download(todo, wheels)
    manifest_path.write_text(json.dumps(wanted, indent=1, sort_keys=True) + "\n")
    _build_project_wheels(wheels)
    _download_debs(root / "deb")


def _have(folder: Path, spec: str) -> bool:
    name, version = spec.split("==")
    return any(w.name == name and str(w.version) == version for w in wheels_in(folder))


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# -- on the device --------------------------------------------------------------------------------


def verify_env() -> list[str]:
    """Every requirement of the installed project packages, followed through what they pull in,
    met by the environment this runs in (python3 with PYTHONPATH): the device's check, in seconds,
    before any server starts."""
    problems: list[str] = []
    queue: list[tuple[Requirement, str]] = [(Requirement(p), "check") for p in PROJECTS]
    seen: set[tuple[str, frozenset[str]]] = set()
    for req, parent in _walk(queue, seen):
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req} (needed by {parent}) is not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} (needed by {parent}): {version} is installed")
    return problems


def _walk(queue: list[tuple[Requirement, str]], seen: set[tuple[str, frozenset[str]]]) -> Iterator[
        tuple[Requirement, str]]:
    while queue:
        req, parent = queue.pop(0)
        yield req, parent
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = metadata.distribution(req.name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for raw in requires:
            sub = Requirement(raw)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                queue.append((sub, canonicalize_name(req.name)))


def import_check(site: Path) -> list[str]:
    """Import every top-level module of every distribution installed in ``site`` (the wheel set in
    its temporary site): a wheel built for another Python or a missing shared library fails here,
    in a second, instead of when a server starts. The project's own packages import only their
    top level (the server's encoders need torch, which is the machine's)."""
    import importlib

    problems = []
    for dist in metadata.distributions(path=[str(site)]):
        for name in _top_level(dist):
            try:
                importlib.import_module(name)
            except Exception as exc:  # the report names the module and the reason, whatever it is
                problems.append(f"{dist.metadata['Name']}: import {name}: {type(exc).__name__}: {exc}")
    return problems


def _top_level(dist: metadata.Distribution) -> list[str]:
    """The importable top-level names a distribution installs (``top_level.txt`` where the wheel
    has one, else the first part of its files' paths); private ones (``_cffi_backend``...) left out."""
    listed = (dist.read_text("top_level.txt") or "").split()
    if listed:
        return [n for n in listed if not n.startswith("_")]
    names = set()
    for file in dist.files or []:
        first, *rest = file.parts
        name = first.removesuffix(".py") if not rest else first
        if name.isidentifier() and not name.startswith("_") and (rest or first.endswith(".py")):
            names.add(name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("derive", "device-needs", "download", "check", "verify-env",
                                            "import-check", "project"))
    parser.add_argument("--dir", type=Path, default=GPU_DIR, help="the folder that travels (default: .gpu)")
    parser.add_argument("--site", type=Path, help="import-check: the site the wheel set was installed into")
    args = parser.parse_args(argv)
    if args.command == "project":  # make dist: the project's two wheels alone, into --dir
        _build_project_wheels(args.dir)
        return 0
    if args.command == "import-check":
        problems = import_check(args.site)
        for p in problems:
            print(f"import: {p}", file=sys.stderr)
        return 1 if problems else 0
    if args.command == "verify-env":
        problems = verify_env()
        for p in problems:
            print(f"missing: {p}", file=sys.stderr)
        return 1 if problems else 0
    device = device_packages()
    if args.command == "derive":
        for c in derive(device):
            print(f"{c.name}=={c.version}  # {c.required_by}")
        return 0
    if args.command == "device-needs":
        print("\n".join(device_needs(device)))
        return 0
    if args.command == "download":
        download(args.dir, device)
    problems = check(args.dir / "wheels", device)
    for p in problems:
        print(f"wheel set: {p}", file=sys.stderr)
    size = folder_bytes(args.dir)
    count = len(list((args.dir / "wheels").glob("*.whl")))
    debs = len(list((args.dir / "deb").glob("*.deb")))
    print(f"{args.dir}: {count} wheels, {debs} .deb files, {size / 2**20:.1f} MiB (carry limit 64 MiB)")
    if size > SIZE_LIMIT:
        print(f"{args.dir} is over the 64 MiB the run tool carries", file=sys.stderr)
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
