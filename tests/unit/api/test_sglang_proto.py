"""SGLang's encoder service as served: the generated code is what ``scripts/gen_proto.py`` makes from
the checked-in proto, and the service, methods and message fields are SGLang's (smg-grpc-proto's),
which its prefill's ``MMReceiverGrpc`` calls by name."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

from encode_server.api.proto.sglang_encoder import sglang_encoder_pb2 as pb

ROOT = Path(__file__).resolve().parents[3]


def test_generated_sglang_grpc_code_matches_the_proto(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_proto.py"), "--out", str(tmp_path)], check=True)
    from scripts.gen_proto import SGLANG_GENERATED, SGLANG_TARGET

    for name in SGLANG_GENERATED:
        assert filecmp.cmp(tmp_path / SGLANG_TARGET / name, ROOT / SGLANG_TARGET / name, shallow=False), name


def test_the_service_and_its_messages_are_sglangs() -> None:
    service = pb.DESCRIPTOR.services_by_name["SglangEncoder"]
    assert service.full_name == "sglang.grpc.encoder.SglangEncoder"
    assert [m.name for m in service.methods] == ["Encode", "Send", "SchedulerReceiveUrl"]
    messages = pb.DESCRIPTOR.message_types_by_name
    fields = {name: [(f.name, f.number) for f in message.fields] for name, message in messages.items()}
    assert fields["EncodeRequest"] == [("mm_items", 1), ("req_id", 2), ("num_parts", 3), ("part_idx", 4),
                                       ("prefill_host", 5), ("embedding_port", 6)]
    assert fields["SchedulerReceiveUrlRequest"] == [("req_id", 1), ("receive_url", 2), ("receive_count", 3)]
    # Registered under its folder's name: never the file name smg-grpc-proto registers in the same process.
    assert pb.DESCRIPTOR.name == "sglang_encoder/sglang_encoder.proto"
