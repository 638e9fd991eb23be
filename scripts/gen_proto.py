"""Generate the gRPC Python code from ``encoder.proto`` (and SGLang's ``sglang_encoder.proto``): the one
way it is made (``make proto``).

The same descriptor goes to the server (``encode_server/api/proto/encode_server/v1``) and the
client (``clients/python/encode_client/_proto``), registered under one file name, so that both
can live in one process. ``protoc`` writes an absolute import in the ``_grpc`` module
(``from encode_server.v1 import encoder_pb2``); it is made relative so each copy finds its own.
SGLang's encoder service (``--sglang``: ``sglang_encoder/sglang_encoder.proto``, from smg-grpc-proto)
goes to the server only, registered under its folder's name, so it never collides with the
``sglang_encoder.proto`` that smg-grpc-proto registers in a process that imports both.
A test regenerates into a temporary folder and compares with the checked-in files.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "encode_server" / "api" / "proto"
PROTO = "encode_server/v1/encoder.proto"
TARGETS = {
    "server": Path("encode_server/api/proto/encode_server/v1"),
    "client": Path("clients/python/encode_client/_proto"),
}
GENERATED = ("encoder_pb2.py", "encoder_pb2.pyi", "encoder_pb2_grpc.py")
SGLANG_PROTO = "sglang_encoder/sglang_encoder.proto"
SGLANG_TARGET = Path("encode_server/api/proto/sglang_encoder")
SGLANG_GENERATED = ("sglang_encoder_pb2.py", "sglang_encoder_pb2.pyi", "sglang_encoder_pb2_grpc.py")


def generate(out: Path) -> None:
    """Write the generated modules for every target under ``out`` (the repository layout)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
                f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO, SGLANG_PROTO,
            ],
            check=True,
        )
        made = Path(tmp) / "encode_server" / "v1"
        grpc_module = made / "encoder_pb2_grpc.py"
        text = grpc_module.read_text()
        absolute = "from encode_server.v1 import encoder_pb2 as"
        assert absolute in text, "protoc changed its import style; update gen_proto.py"
        grpc_module.write_text(text.replace(absolute, "from . import encoder_pb2 as"))
        for target in TARGETS.values():
            dest = out / target
            dest.mkdir(parents=True, exist_ok=True)
            for name in GENERATED:
                shutil.copyfile(made / name, dest / name)
        sglang = Path(tmp) / "sglang_encoder"
        grpc_module = sglang / "sglang_encoder_pb2_grpc.py"
        text = grpc_module.read_text()
        absolute = "from sglang_encoder import sglang_encoder_pb2 as"
        assert absolute in text, "protoc changed its import style; update gen_proto.py"
        grpc_module.write_text(text.replace(absolute, "from . import sglang_encoder_pb2 as"))
        dest = out / SGLANG_TARGET
        dest.mkdir(parents=True, exist_ok=True)
        for name in SGLANG_GENERATED:
            shutil.copyfile(sglang / name, dest / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="repository root to write into")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
