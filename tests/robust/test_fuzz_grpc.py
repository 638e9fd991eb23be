"""gRPC fuzzing: generated messages for every RPC, oversized messages, and bytes that are not a
protobuf at all, sent on a raw channel. Only the documented status codes come back (DESIGN
section 7), never UNKNOWN nor INTERNAL, and the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encode_server.api.proto.encode_server.v1 import encoder_pb2 as pb
from encode_server.api.proto.encode_server.v1 import encoder_pb2_grpc as pb_grpc
from tests.calls import h, server_errors
from tests.images import image_bytes
from tests.server import ServerProcess

pytestmark = pytest.mark.integration

DOCUMENTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
GOOD = image_bytes("PNG", 32, 32, seed=4242)

hashes = st.one_of(st.text(max_size=70), st.text("0123456789abcdefABCDEF", min_size=64, max_size=64), st.just(h(GOOD)))
datas = st.one_of(st.binary(max_size=256), st.just(GOOD), st.just(GOOD[: len(GOOD) // 2]))
items = st.builds(
    lambda hh, d: pb.Item(**{k: v for k, v in (("hash", hh), ("data", d)) if v is not None}),
    st.none() | hashes, st.none() | datas,
)
int64 = st.integers(-(2**63), 2**63 - 1)
requests = {
    "Encode": st.builds(pb.EncodeRequest, items=st.lists(items, max_size=10),
                        return_kind=st.integers(-5, 5)),  # proto3 enums are open: unknown values arrive
    "Lookup": st.builds(pb.LookupRequest, hashes=st.lists(hashes, max_size=10)),
    "Tokens": st.builds(
        pb.TokensRequest, items=st.lists(items, max_size=4),
        sizes=st.lists(st.builds(pb.Size, width=int64 | st.integers(0, 5000), height=int64 | st.integers(0, 5000)),
                       max_size=5),
    ),
    "Model": st.just(pb.ModelRequest()),
}


@pytest.fixture(scope="module")
def channel(robust_server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(robust_server.grpc_target) as ch:
        yield ch


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("rpc", sorted(requests))
def test_generated_messages_get_only_documented_codes(
    rpc: str, channel: grpc.Channel, robust_server: ServerProcess
) -> None:
    stub = pb_grpc.EncoderStub(channel)
    seen: set[grpc.StatusCode] = set()

    @FUZZ
    @given(requests[rpc])
    def run(request: object) -> None:
        code = _code(lambda: getattr(stub, rpc)(request, timeout=30))
        seen.add(code)
        assert code in DOCUMENTED, (rpc, code, request)

    run()
    assert seen, rpc
    assert server_errors(robust_server) == 0


@FUZZ
@given(st.sampled_from(sorted(requests)), st.binary(max_size=512))
def test_bytes_that_are_not_protobuf_are_invalid_argument(channel: grpc.Channel, rpc: str, raw: bytes) -> None:
    call = channel.unary_unary(f"/encode_server.v1.Encoder/{rpc}")  # no serializers: raw bytes
    code = _code(lambda: call(raw, timeout=30))
    assert code in DOCUMENTED - {grpc.StatusCode.UNAVAILABLE}, (rpc, code, raw)


def test_known_garbage_is_invalid_argument_and_the_server_keeps_serving(channel: grpc.Channel) -> None:
    for raw in (b"\xff" * 16, b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05ab", b"\x08" * 3):
        call = channel.unary_unary("/encode_server.v1.Encoder/Encode")
        with pytest.raises(grpc.RpcError) as info:
            call(raw, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    got = pb_grpc.EncoderStub(channel).Encode(pb.EncodeRequest(items=[pb.Item(data=GOOD)]), timeout=30)
    assert got.items[0].status in ("encoded", "hit")


def test_oversized_messages_are_resource_exhausted(channel: grpc.Channel, robust_server: ServerProcess) -> None:
    stub = pb_grpc.EncoderStub(channel)
    big = pb.EncodeRequest(items=[pb.Item(data=b"\x00" * (5 * 1024 * 1024))])  # --max-request-bytes is 4 MiB
    assert _code(lambda: stub.Encode(big, timeout=30)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    many = pb.LookupRequest(hashes=["0" * 64] * 5000)
    assert _code(lambda: stub.Lookup(many, timeout=30)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server_errors(robust_server) == 0
