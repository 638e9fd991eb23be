"""docs/cache.md against the code: its test vectors, its example key and value, its list of
fingerprint fields, and its portable reader, run on values the server's own writer produced."""

from __future__ import annotations

import ast
import json
import re

import numpy as np

from encode_server.core.hashing import cache_key, frame, tenant_digest
from encode_server.core.stored import ValueSpec, decode_value, encode_value
from encode_server.core.types import Embedding, EncodedTensor
from encode_server.core.wire import from_numpy
from tests.docs.markdown import ROOT, tables

DOC = (ROOT / "docs" / "cache.md").read_text()
FINGERPRINT = "0b8eb1318565e12af45a557e545766d8d3df266452645314e965533c213ec2bf"  # builtin:tiny's (test_samples.py)
MM_HASH = "74ab274e9f9b0d74e5aad0d97d65c0b0000cadb796d82183a33ad8bac0efcbc7"


def _code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC, re.MULTILINE | re.DOTALL)


def test_the_tenant_vector() -> None:
    stated = re.search(r'tenant_digest\("acme"\) = ([0-9a-f]{64})', DOC)
    assert stated and stated.group(1) == tenant_digest("acme")
    framed = frame("encode-server/tenant/v1", "acme")
    assert f"is the {len(framed)} bytes" in DOC
    assert re.search(r"`([0-9a-f ]+)`\n\(list of 2", DOC).group(1).replace(" ", "") == framed.hex()  # type: ignore[union-attr]


def test_the_example_key() -> None:
    assert f"\nencode:v1:{FINGERPRINT}:{MM_HASH}\n" in DOC
    assert cache_key(FINGERPRINT, MM_HASH) == f"encode:v1:{FINGERPRINT}:{MM_HASH}"


def _value(dtype: str, shape: tuple[int, int] = (99, 128)) -> bytes:
    rows = np.random.default_rng(0).standard_normal(shape).astype("<f4")
    t = from_numpy("embedding", rows, dtype=dtype)
    value = Embedding(EncodedTensor(t.data, t.shape, dtype), {"image_grid_thw": [1, 18, 22]})
    return encode_value(FINGERPRINT, MM_HASH, value)


def test_the_example_value_is_what_the_writer_writes() -> None:
    blob = _value("float32")
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    documented = next(json.loads(b) for b in _code_blocks("json") if '"__metadata__"' in b)
    assert header == documented
    assert blob[8 : 8 + n].endswith(b" ") and n % 8 == 0
    assert f"is 8 + {n} + {99 * 128 * 4} = {len(blob)} bytes" in DOC


def test_the_documented_fields_are_the_fingerprints() -> None:
    """The fingerprint table lists exactly the fields ``model_fingerprint`` hashes."""
    tree = ast.parse((ROOT / "encode_server" / "fingerprints.py").read_text())
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "model_fingerprint")
    dicts = [n for n in ast.walk(function) if isinstance(n, ast.Dict)]
    hashed = {k.value for d in dicts for k in d.keys if isinstance(k, ast.Constant)}
    table = next(t for t in tables(DOC) if t[0] == ["field", "what"] and "`weights_digest`" in t[1][0])
    assert {row[0].strip("`") for row in table[1:]} == hashed


def test_the_portable_reader_reads_what_the_server_writes() -> None:
    """The standard-library reader in the doc, run as written, on float32, float16 and bfloat16."""
    source = next(b for b in _code_blocks("python") if "def read_embedding" in b)
    scope: dict[str, object] = {}
    exec(compile(source, "docs/cache.md", "exec"), scope)
    read = scope["read_embedding"]
    key = cache_key(FINGERPRINT, MM_HASH)
    spec = {d: ValueSpec(FINGERPRINT, d, 128) for d in ("float32", "float16", "bfloat16")}
    for dtype in spec:
        blob = _value(dtype)
        expected = decode_value(blob, spec[dtype], MM_HASH)  # the server's own strict reader
        x, meta = read(blob, key, FINGERPRINT)  # type: ignore[operator]
        assert meta == expected.meta == {"image_grid_thw": [1, 18, 22]}
        assert x.shape == (99, 128)
        if dtype == "bfloat16":  # widened exactly: the top 16 bits of each float32 are the bf16 bits
            raw = np.frombuffer(expected.tensor.data, "<u2")
            assert np.array_equal((x.view("<u4") >> 16).astype("<u2").ravel(), raw)
        else:
            stored = np.frombuffer(expected.tensor.data, "<f4" if dtype == "float32" else "<f2")
            assert np.array_equal(x, stored.reshape(99, 128))
