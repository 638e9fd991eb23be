"""README.md is what a new user reads first: it must show the two commands, the client, the CLI and
a gRPC call. (Every dashboard panel and alert is explained in docs/metrics.md: tests/docs.)"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_commands_the_client_the_cli_and_grpc_are_shown() -> None:
    for needle in ("make serve", "make test", "make bench", "from encode_client import", "encode-client warm",
                   "encode-client hash", "grpcurl", "/v1/tokens", "--redis-url", "StoreReader"):
        assert needle in README, needle
