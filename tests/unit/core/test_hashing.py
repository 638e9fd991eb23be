"""Image hashes, fingerprints and cache keys: each test is named for the mix-up it rules out."""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from encode_server.core.errors import BadInput
from encode_server.core.hashing import (
    FINGERPRINT_VERSION,
    CacheKey,
    cache_key,
    fingerprint,
    frame,
    is_mm_hash,
    mm_hash,
    parse_mm_hash,
    tenant_digest,
)
from tests.tools import require_tool

FP = "f" * 64
H = "0123456789abcdef" * 4


def _pattern(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


# -- mm_hash ---------------------------------------------------------------------------------------

# From BLAKE3's official test_vectors.json (input byte i is i % 251), default 32-byte output.
BLAKE3_VECTORS = {
    0: "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    1: "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
    1023: "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11",
    1024: "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
    1025: "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
    2048: "e776b6028c7cd22a4d0ba182a8bf62205d2ef576467e838ed6f2529b85fba24a",
}


@pytest.mark.parametrize(("length", "expected"), sorted(BLAKE3_VECTORS.items()))
def test_mm_hash_matches_official_blake3_vectors(length: int, expected: str) -> None:
    assert mm_hash(_pattern(length)) == expected


def test_mm_hash_of_abc_matches_known_digest() -> None:
    assert mm_hash(b"abc") == "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"


def test_mm_hash_is_never_truncated_and_is_lowercase() -> None:
    h = mm_hash(b"\x89PNG\r\n\x1a\n")
    assert len(h) == 64
    assert h == h.lower()
    assert is_mm_hash(h)


def test_mm_hash_is_the_same_for_any_buffer_type() -> None:
    data = _pattern(5000)
    assert mm_hash(data) == mm_hash(bytearray(data)) == mm_hash(memoryview(data))


def test_mm_hash_differs_for_one_flipped_bit() -> None:
    data = bytearray(_pattern(4096))
    before = mm_hash(data)
    data[4000] ^= 1
    assert mm_hash(data) != before


def test_mm_hash_equals_b3sum_output(tmp_path: Path) -> None:
    b3sum = require_tool("b3sum")
    path = tmp_path / "image.bin"
    path.write_bytes(_pattern(70_000))
    out = subprocess.run([b3sum, "--no-names", str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == mm_hash(path.read_bytes())


# -- is_mm_hash / parse_mm_hash --------------------------------------------------------------------


@pytest.mark.parametrize(
    "candidate",
    [
        "",
        "a" * 63,
        "a" * 65,
        "a" * 16,  # a truncated 64-bit hash
        "g" + "a" * 63,
        "0x" + "a" * 62,
        "a" * 64 + "\n",
        " " + "a" * 63,
        "a" * 63 + " ",
        "\uff10" * 64,  # fullwidth digits are not ASCII hex
        "\u0660" * 64,  # Arabic-Indic digits
    ],
)
def test_is_mm_hash_rejects_anything_but_64_ascii_hex_digits(candidate: str) -> None:
    assert not is_mm_hash(candidate)
    with pytest.raises(BadInput) as info:
        parse_mm_hash(candidate)
    assert info.value.type == "invalid_hash"
    assert info.value.index is None


@pytest.mark.parametrize("candidate", [None, 123, b"a" * 64, ["a" * 64], {"hash": "a" * 64}])
def test_parse_mm_hash_rejects_non_strings_as_bad_input(candidate: object) -> None:
    assert not is_mm_hash(candidate)  # type: ignore[arg-type]
    with pytest.raises(BadInput) as info:
        parse_mm_hash(candidate)
    assert info.value.type == "invalid_hash"


def test_parse_mm_hash_canonicalises_uppercase_to_lowercase() -> None:
    h = mm_hash(b"image")
    assert is_mm_hash(h.upper())
    assert parse_mm_hash(h.upper()) == h
    assert parse_mm_hash(h) == h


def test_parse_mm_hash_message_is_bounded_for_huge_input() -> None:
    with pytest.raises(BadInput) as info:
        parse_mm_hash("z" * 1_000_000)
    assert len(info.value.message) < 300


# -- frame -----------------------------------------------------------------------------------------


def test_frame_string_boundaries_cannot_shift() -> None:
    assert frame("ab", "c") != frame("a", "bc")
    assert frame("abc") != frame("ab", "c")
    assert frame(b"ab", b"c") != frame(b"a", b"bc")


def test_frame_int_str_bool_float_bytes_none_never_alike() -> None:
    values: list[object] = [1, "1", True, 1.0, b"1", b"\x01", None, 0, False, 0.0, "", b"", [], {}, "None"]
    framed = [frame(v) for v in values]
    assert len(set(framed)) == len(values)


def test_frame_nested_lists_differ_from_flat() -> None:
    assert frame([1, 2]) != frame(1, 2)
    assert frame([[1], [2]]) != frame([[1, 2]])
    assert frame([[], [1, 2]]) != frame([[1, 2], []])
    assert frame([[1, 2]]) != frame([1, [2]])


def test_frame_dict_differs_from_list_of_pairs() -> None:
    assert frame({"a": 1}) != frame([["a", 1]])
    assert frame({"a": 1}) != frame(["a", 1])
    assert frame({"a": 1}) != frame("a", 1)


def test_frame_dict_key_value_boundaries_cannot_shift() -> None:
    assert frame({"ab": "c"}) != frame({"a": "bc"})
    assert frame({"a": "b", "c": "d"}) != frame({"a": "bc", "": "d"})
    assert frame({"a": {"b": 1}}) != frame({"a": [["b", 1]]})


def test_frame_dict_key_order_does_not_change_the_bytes() -> None:
    assert frame({"b": 2, "a": 1}) == frame({"a": 1, "b": 2})
    assert frame(MappingProxyType({"a": 1})) == frame({"a": 1})


def test_frame_tuple_and_list_are_the_same_value() -> None:
    # A config read back from JSON (lists) must fingerprint like the one built in code (tuples).
    assert frame((1, (2, 3))) == frame([1, [2, 3]])


def test_frame_negative_zero_and_zero_differ() -> None:
    assert frame(0.0) != frame(-0.0)


def test_frame_ints_of_any_size_never_alike() -> None:
    values = [0, -1, 1, 127, 128, 255, 256, -128, -129, 2**63, 2**64, -(2**64), 10**100]
    assert len({frame(v) for v in values}) == len(values)


def test_frame_arity_is_part_of_the_bytes() -> None:
    assert frame("a") != frame("a", None)
    assert frame() != frame(None)
    assert frame("a") != frame(["a"])
    assert not frame("a", "b").startswith(frame("a"))


def test_frame_str_and_bytes_with_same_content_differ() -> None:
    assert frame("abc") != frame(b"abc")


def test_frame_encodes_lone_surrogates_distinctly() -> None:
    assert frame("\ud83d\ude00") != frame("\U0001f600")


class _Unframable:
    pass


@pytest.mark.parametrize("value", [{1, 2}, _Unframable(), frozenset(), 1j, range(3), {1: "a"}, {("a",): 1}])
def test_frame_rejects_types_it_cannot_serialise_unambiguously(value: object) -> None:
    with pytest.raises(TypeError):
        frame(value)


def test_frame_rejects_cyclic_values() -> None:
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(ValueError):
        frame(cycle)


# A decoder for frame's bytes: frame has a left inverse on canonical values, so it is injective.
def _decode(buf: bytes, pos: int = 0) -> tuple[Any, int]:
    tag = buf[pos : pos + 1]
    pos += 1
    if tag == b"N":
        return None, pos
    if tag in (b"T", b"F"):
        return tag == b"T", pos
    if tag == b"f":
        return struct.unpack(">d", buf[pos : pos + 8])[0], pos + 8
    n = int.from_bytes(buf[pos : pos + 8], "little")
    pos += 8
    if tag == b"i":
        return int.from_bytes(buf[pos : pos + n], "big", signed=True), pos + n
    if tag == b"s":
        return buf[pos : pos + n].decode("utf-8", "surrogatepass"), pos + n
    if tag == b"b":
        return buf[pos : pos + n], pos + n
    if tag == b"l":
        items = []
        for _ in range(n):
            item, pos = _decode(buf, pos)
            items.append(item)
        return items, pos
    if tag == b"d":
        out = {}
        for _ in range(n):
            key, pos = _decode(buf, pos)
            out[key], pos = _decode(buf, pos)
        return out, pos
    raise AssertionError(f"unknown tag {tag!r}")


def _canonical(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


def _typed(value: object) -> object:
    """Equality that tells 1 from True from 1.0 (plain == does not)."""
    if isinstance(value, list):
        return ("list", [_typed(v) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((k, _typed(v)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", struct.pack(">d", value))
    return (type(value).__name__, value)


framable = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(framable, max_size=4))
def test_frame_decodes_back_to_its_input_so_distinct_inputs_never_collide(fields: list[object]) -> None:
    buf = frame(*fields)
    decoded, end = _decode(buf)
    assert end == len(buf)
    assert _typed(decoded) == _typed(_canonical(fields))


@settings(max_examples=300, deadline=None)
@given(framable, framable)
def test_frame_of_distinct_values_differs(a: object, b: object) -> None:
    if _typed(_canonical(a)) != _typed(_canonical(b)):
        assert frame(a) != frame(b)
    else:
        assert frame(a) == frame(b)


# -- fingerprint -----------------------------------------------------------------------------------

FIELDS: dict[str, object] = {
    "model_id": "Qwen/Qwen2.5-VL-7B-Instruct",
    "revision": "main",
    "weights_digest": "ab" * 32,
    "dtype": "bfloat16",
    "preprocessing": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "mean": [0.5, 0.5]},
    "output": "hidden",
    "kind": "qwen2_5_vl",
}


def test_fingerprint_is_a_full_lowercase_blake3_digest() -> None:
    f = fingerprint(FIELDS)
    assert len(f) == 64
    assert is_mm_hash(f) and f == f.lower()


def test_fingerprint_golden_value_changes_only_with_the_version_tag() -> None:
    # If this fails, the fingerprint format changed: bump FINGERPRINT_VERSION so that old cache
    # entries cannot be read under a new serialisation, then update the value here.
    assert FINGERPRINT_VERSION == "encode-server/fingerprint/v1"
    assert fingerprint({"model_id": "m", "n": 1, "cfg": {"a": [1.5, None, True]}}) == (
        "d0f281daf4779e00b4d452a96fdd617f3be1180348526c44f89498c2f33b8cef"
    )


def test_fingerprint_ignores_field_order() -> None:
    assert fingerprint(dict(reversed(list(FIELDS.items())))) == fingerprint(FIELDS)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_id", "Qwen/Qwen2.5-VL-3B-Instruct"),
        ("revision", "refs/pr/1"),
        ("weights_digest", "cd" * 32),
        ("dtype", "float32"),
        ("output", "pooled"),
        ("kind", "llava"),
        ("preprocessing", {**FIELDS["preprocessing"], "max_pixels": 1003520}),  # type: ignore[dict-item]
        ("preprocessing", {**FIELDS["preprocessing"], "mean": [0.5, 0.50001]}),  # type: ignore[dict-item]
        ("weights_digest", None),
    ],
)
def test_fingerprint_changes_when_anything_that_changes_the_embedding_changes(field: str, value: object) -> None:
    assert fingerprint({**FIELDS, field: value}) != fingerprint(FIELDS)


def test_fingerprint_distinguishes_a_missing_field_from_a_none_field() -> None:
    without = {k: v for k, v in FIELDS.items() if k != "revision"}
    assert fingerprint(without) != fingerprint({**without, "revision": None})


def test_fingerprint_int_and_str_fields_never_alike() -> None:
    assert fingerprint({"patch_size": 14}) != fingerprint({"patch_size": "14"})


def test_fingerprint_is_domain_separated_from_plain_frame_hash() -> None:
    assert fingerprint(FIELDS) != mm_hash(frame(FIELDS))


def test_fingerprint_rejects_nan_which_has_many_bit_patterns() -> None:
    with pytest.raises(ValueError, match="NaN"):
        fingerprint({"preprocessing": {"mean": [float("nan")]}})


def test_fingerprint_rejects_non_mapping() -> None:
    with pytest.raises(TypeError):
        fingerprint([("model_id", "m")])  # type: ignore[arg-type]


# -- cache keys ------------------------------------------------------------------------------------


def test_cache_key_layout_without_tenant() -> None:
    assert cache_key(FP, H) == f"encode:v1:{FP}:{H}"
    assert cache_key(FP, H, prefix="prod:encode") == f"prod:encode:v1:{FP}:{H}"


def test_cache_key_layout_with_tenant_uses_a_digest_of_the_tenant() -> None:
    key = cache_key(FP, H, tenant="acme")
    assert key == f"encode:v1:{FP}:t:{tenant_digest('acme')}:{H}"
    assert "acme" not in key


def test_tenant_digest_is_full_length_and_domain_separated_from_image_hashes() -> None:
    d = tenant_digest("acme")
    assert len(d) == 64 and is_mm_hash(d)
    assert d != mm_hash(b"acme")


def test_cache_key_of_another_model_never_collides() -> None:
    assert cache_key(FP, H) != cache_key("e" * 64, H)


def test_cache_key_tenants_never_share_entries() -> None:
    keys = {cache_key(FP, H), cache_key(FP, H, tenant="a"), cache_key(FP, H, tenant="b")}
    assert len(keys) == 3


def test_cache_key_tenant_containing_colons_cannot_forge_another_key() -> None:
    victim = cache_key(FP, H, tenant="victim")
    # With raw ids, tenant "victim:x" or one holding a fingerprint/hash could splice segments.
    for forged in ["victim:", f"victim:{H}", f"t:{tenant_digest('victim')}", f"{tenant_digest('victim')}"]:
        key = cache_key(FP, H, tenant=forged)
        assert key != victim
        assert key.split(":")[-3] == "t" and len(key.split(":")) == len(victim.split(":"))


def test_cache_key_without_tenant_never_equals_one_with_tenant() -> None:
    # Read from the right: segment -3 is "t" only in tenant keys; in others it is "v1".
    assert cache_key(FP, H).split(":")[-3] == "v1"


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=12), st.text(min_size=1, max_size=12))
def test_cache_key_distinct_tenants_give_distinct_keys(a: str, b: str) -> None:
    if a != b:
        assert cache_key(FP, H, tenant=a) != cache_key(FP, H, tenant=b)


@pytest.mark.parametrize(
    ("fp", "h"),
    [
        (FP, H.upper()),  # must be canonicalised by parse_mm_hash first
        (FP.upper(), H),
        (FP, H[:16]),  # truncated
        (FP[:32], H),
        (FP, H + "0"),
    ],
)
def test_cache_key_refuses_non_canonical_digests(fp: str, h: str) -> None:
    with pytest.raises(ValueError):
        cache_key(fp, h)


@pytest.mark.parametrize("prefix", ["", "with space", "tab\t", "new\nline"])
def test_cache_key_refuses_bad_prefixes(prefix: str) -> None:
    with pytest.raises(ValueError):
        cache_key(FP, H, prefix=prefix)


def test_cache_key_refuses_empty_tenant() -> None:
    with pytest.raises(ValueError):
        cache_key(FP, H, tenant="")


# -- modality in the key ----------------------------------------------------------------------------


def test_a_video_key_names_its_modality_and_an_image_key_is_unchanged() -> None:
    assert cache_key(FP, H, modality="image") == f"encode:v1:{FP}:{H}"  # as before modalities were keyed
    assert cache_key(FP, H, modality="video") == f"encode:v1:{FP}:video:{H}"
    tenant = tenant_digest("acme")
    assert cache_key(FP, H, tenant="acme", modality="video") == f"encode:v1:{FP}:t:{tenant}:video:{H}"


@pytest.mark.parametrize("tenant", [None, "acme", "video", "t"])
def test_one_files_bytes_as_a_video_never_address_its_image_entry(tenant: str | None) -> None:
    image, video = CacheKey(FP, H, tenant=tenant), CacheKey(FP, H, tenant=tenant, modality="video")
    assert image != video and image.text != video.text and hash(image) != hash(video)
    assert image.identifier == image.text.removeprefix(f"encode:v1:{FP}:")
    assert video.identifier == video.text.removeprefix(f"encode:v1:{FP}:")
    assert video.identifier.endswith(f"video:{H}") and not image.identifier.endswith(f"video:{H}")


def test_a_prefix_named_like_a_modality_reads_unambiguously() -> None:
    # Read from the right, the segment before the mm_hash is "video" only in a video's key.
    assert cache_key(FP, H, prefix="video").split(":")[-2] == FP
    assert cache_key(FP, H, prefix="video", modality="video").split(":")[-2] == "video"


@pytest.mark.parametrize("modality", ["", "Video", "text", "images", "Audio"])
def test_cache_key_refuses_an_unknown_modality(modality: str) -> None:
    with pytest.raises(ValueError, match="modality"):
        cache_key(FP, H, modality=modality)


_SETTINGS = "5e" * 32


def test_a_settings_digest_goes_after_the_tenant_and_before_the_modality() -> None:
    tenant = tenant_digest("acme")
    key = CacheKey(FP, H, "encode", "acme", "video", _SETTINGS)
    assert key.text == f"encode:v1:{FP}:t:{tenant}:p:{_SETTINGS}:video:{H}"
    assert key.identifier == f"t:{tenant}:p:{_SETTINGS}:video:{H}"


def test_one_image_under_two_settings_never_shares_a_key_and_the_defaults_keep_todays() -> None:
    plain = CacheKey(FP, H)
    assert plain.text == f"encode:v1:{FP}:{H}"
    assert CacheKey(FP, H, settings=_SETTINGS) != plain
    assert CacheKey(FP, H, settings=_SETTINGS) != CacheKey(FP, H, settings="6f" * 32)


@pytest.mark.parametrize("settings", ["", "5E" * 32, "5e" * 31, "p"])
def test_cache_key_refuses_a_settings_part_that_is_not_a_digest(settings: str) -> None:
    with pytest.raises(ValueError, match="settings"):
        CacheKey(FP, H, settings=settings)
