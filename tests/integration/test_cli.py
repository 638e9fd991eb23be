"""``encode-client`` as a user runs it (a subprocess) against a real server: arguments taken one by
one (a bad one is reported, the rest still processed, the exit code says so), files and hashes
mixed, the connection options before or after the subcommand, and a self-describing ``--help``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from blake3 import blake3

from tests.images import image_bytes
from tests.server import ServerProcess, free_port

CLI = [sys.executable, "-m", "encode_client.cli"]


def cli(*args: str, cwd: Path | None = None, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENCODE_CLIENT_")}
    if url:
        env["ENCODE_CLIENT_URL"] = url
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env)


def images(folder: Path) -> tuple[Path, Path]:
    cat, dog = folder / "cat.png", folder / "dog.jpg"
    cat.write_bytes(image_bytes("PNG", 64, 48, seed=2401))
    dog.write_bytes(image_bytes("JPEG", 40, 30, seed=2402))
    return cat, dog


def test_lookup_takes_files_and_hashes_mixed_and_reports_each_bad_one(
    builtin_server: ServerProcess, tmp_path: Path
) -> None:
    cat, dog = images(tmp_path)
    dog_hash = blake3(dog.read_bytes()).hexdigest()
    done = cli("lookup", str(cat), "5808…", dog_hash, str(tmp_path / "gone.png"), "00" * 32, url=builtin_server.url)
    assert done.returncode == 2, done.stderr  # some arguments failed ...
    rows = [line.split() for line in done.stdout.splitlines()]
    # ... and every other one was looked up, in the order given
    assert [(r[0], r[-1]) for r in rows] == [
        (blake3(cat.read_bytes()).hexdigest(), str(cat)), (dog_hash, dog_hash), ("00" * 32, "00" * 32)
    ]
    errors = done.stderr.splitlines()
    assert len(errors) == 2 and "5808…" in errors[0] and "gone.png" in errors[1], done.stderr


def test_hash_encode_and_tokens_report_each_unreadable_file_and_do_the_rest(
    builtin_server: ServerProcess, tmp_path: Path
) -> None:
    cat, dog = images(tmp_path)
    missing = str(tmp_path / "gone.png")
    hashed = cli("hash", str(cat), missing, str(dog))
    assert hashed.returncode == 2 and [line.split()[1] for line in hashed.stdout.splitlines()] == [str(cat), str(dog)]
    assert "gone.png" in hashed.stderr
    counted = cli("tokens", missing, str(cat), url=builtin_server.url)
    assert counted.returncode == 2 and counted.stdout.split()[-1] == str(cat), counted.stderr
    out = tmp_path / "out.safetensors"
    encoded = cli("encode", str(cat), missing, str(dog), "-o", str(out), url=builtin_server.url)
    assert encoded.returncode == 2 and "gone.png" in encoded.stderr, encoded.stderr
    assert [line.split()[-1] for line in encoded.stdout.splitlines()] == [str(cat), str(dog)]
    assert out.exists()


def test_encode_writes_the_model_and_fingerprint_the_server_writes(
    builtin_server: ServerProcess, tmp_path: Path
) -> None:
    from safetensors import safe_open  # the reference reader

    cat, dog = images(tmp_path)
    out = tmp_path / "out.safetensors"
    done = cli("encode", str(cat), str(dog), "-o", str(out), url=builtin_server.url)
    assert done.returncode == 0, done.stderr
    model = httpx.get(builtin_server.url + "/v1/model").json()
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
        assert sorted(f.keys()) == ["0", "1"]
    assert (metadata["model"], metadata["fingerprint"]) == (model["model"], model["fingerprint"])
    assert [item["file"] for item in json.loads(metadata["items"])] == [str(cat), str(dog)]


def test_connection_options_are_taken_before_or_after_the_subcommand(
    builtin_server: ServerProcess, tmp_path: Path
) -> None:
    cat, _ = images(tmp_path)
    nowhere = "http://127.0.0.1:9"  # nothing listens on the discard port
    after = cli("tokens", str(cat), "--url", builtin_server.url, "--api-key", "unused", "--timeout", "30")
    assert after.returncode == 0, after.stderr
    before = cli("--url", builtin_server.url, "--timeout", "30", "tokens", str(cat))
    assert before.returncode == 0 and before.stdout == after.stdout, before.stderr
    # --url before and after add up: a dead replica first, the live one from after the subcommand
    both = cli("--url", nowhere, "lookup", "00" * 32, "--url", builtin_server.url)
    assert both.returncode == 0 and "missing" in both.stdout, both.stderr


def test_help_shows_the_defaults_and_the_exit_codes() -> None:
    for args in ([], ["lookup"], ["warm"]):
        done = cli(*args, "--help")
        assert done.returncode == 0
        text = " ".join(done.stdout.split())
        assert "default: $ENCODE_CLIENT_URL, URLs separated by commas, else http://127.0.0.1:8000" in text, text
        assert "(default: 60)" in text and "exit codes:" in text and "3 no replica answered" in text, text
    assert "(default: 4)" in " ".join(cli("warm", "--help").stdout.split())


def test_warm_counts_in_the_singular_for_one(builtin_server: ServerProcess, tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    images(folder)
    (folder / "broken.png").write_bytes(b"\x89PNG broken")
    (folder / "dog.jpg").unlink()
    done = cli("warm", str(folder), url=builtin_server.url)
    assert done.returncode == 1, done.stderr  # one image refused
    summary = done.stderr.splitlines()[-1]
    assert "warmed 2 images" in summary and ", 1 error" in summary and "1 errors" not in summary, done.stderr
    assert ("1 miss " in summary) != ("1 hit," in summary), summary


def test_warm_with_nothing_listening_says_so_in_one_line_and_leaves_no_coroutine_behind(tmp_path: Path) -> None:
    """Before: the other uploads were left running when the first found no replica, and died with
    the event loop: ``RuntimeWarning: coroutine ... was never awaited`` at exit."""
    for i in range(12):
        (tmp_path / f"{i}.png").write_bytes(image_bytes("PNG", 8, 8, seed=i))
    done = cli("warm", str(tmp_path), url=f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 3, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "no replica answered" in lines[0], done.stderr
