"""A ``grpc://`` replica without the ``[grpc]`` extra: a clear error naming the extra, from the
client when it is made and from the CLI as a usage error (exit 2), never a ModuleNotFoundError.
Each case runs in a subprocess whose import system cannot find grpc, as where it is not installed."""

from __future__ import annotations

import subprocess
import sys

NO_GRPC = """
import sys

class NoGrpc:
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith("grpc."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoGrpc())
"""
INSTALL = "pip install './clients/python[grpc]'"  # the package is on no index: the checkout's (or its wheel)


def without_grpc(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_GRPC + code, *args], capture_output=True, text=True, timeout=60)


def test_the_client_refuses_a_grpc_replica_when_made_naming_the_extra() -> None:
    done = without_grpc(
        "import encode_client\n"
        "from encode_client import AsyncClient, Client, EncodeClientError, MissingExtra\n"
        "for make in (Client, AsyncClient):\n"
        "    try:\n"
        "        make(['http://127.0.0.1:1', 'grpc://127.0.0.1:1'])\n"
        "    except MissingExtra as exc:\n"
        "        assert isinstance(exc, ImportError) and isinstance(exc, EncodeClientError)\n"
        "        assert (exc.extra, exc.name) == ('grpc', 'grpc')\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
        "Client(['http://127.0.0.1:1']).close()  # HTTP needs no extra\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(line == lines[0] for line in lines), lines
    assert lines[0].startswith("a grpc:// replica needs the [grpc] extra (grpc is not installed): ")
    assert INSTALL in lines[0]


def test_the_cli_says_which_extra_and_exits_as_a_usage_error() -> None:
    main = "from encode_client.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    for args in (["--url", "grpc://127.0.0.1:1", "lookup", "ab" * 32], ["warm", ".", "--url", "grpc://127.0.0.1:1"]):
        done = without_grpc(main, *args)
        assert done.returncode == 2, (args, done.stderr)  # bad usage, not 1 ("the server refused")
        assert done.stderr.startswith("encode-client: a grpc:// replica needs the [grpc] extra"), done.stderr
        assert INSTALL in done.stderr and "Traceback" not in done.stderr and "ModuleNotFoundError" not in done.stderr


def test_the_cli_help_names_the_extra_beside_grpc_urls() -> None:
    done = subprocess.run([sys.executable, "-m", "encode_client.cli", "lookup", "--help"],
                          capture_output=True, text=True, timeout=60)
    text = " ".join(done.stdout.split())
    assert "grpc:// (grpc:// needs the [grpc] extra, below;" in text, text
    assert f"grpc:// replicas need the [grpc] extra (grpcio, protobuf): {INSTALL}" in text, text
