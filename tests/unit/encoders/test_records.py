"""The tests' family records follow ``encoders.FAMILIES``: a family added without its record (its
tiny checkpoints, its reference) fails here, before any table that should list it is missed."""

from __future__ import annotations

from encode_server.encoders import FAMILIES
from tests.integration.test_audio import AUDIO_FAMILIES
from tests.integration.test_families import CASES
from tests.tiny.records import RECORDS, builder
from tests.vllm.families import CASES as VLLM_CASES


def test_every_family_has_one_record_and_no_record_outlives_its_family() -> None:
    assert sorted(RECORDS) == sorted(family.name for family in FAMILIES), "tests/tiny/records.py against FAMILIES"


def test_a_records_checkpoints_are_model_types_its_family_serves() -> None:
    by_name = {family.name: family for family in FAMILIES}
    for name, record in RECORDS.items():
        assert record.builders, name
        assert set(record.builders) <= set(by_name[name].model_types), (name, list(record.builders))


def test_every_model_type_has_at_most_one_builder() -> None:
    kinds = [kind for record in RECORDS.values() for kind in record.builders]
    assert len(kinds) == len(set(kinds)), kinds
    assert all(builder(kind) is not None for kind in kinds)


def test_the_per_family_server_tests_cover_every_family() -> None:
    """An image family has its server in test_families.py, an audio family in test_audio.py."""
    assert {case.record.name for case in CASES.values()} | set(AUDIO_FAMILIES) == set(RECORDS)


def test_the_vllm_parity_cases_are_the_pixels_uuid_families() -> None:
    """tests/vllm/test_image_families.py runs every family whose images go as pixels + uuid (Qwen3-Omni's
    too, whose audio is pixel-free: test_qwen3_omni.py); the pixel-free ones have their own modules
    there (test_connector.py: Qwen2.5-VL; test_qwen3_vl.py: Qwen3-VL, Qwen3.5)."""
    pixels_uuid = {f.name for f in FAMILIES
                   if f.epd is not None and "image" in f.modalities and f.epd.mode_of("image") == "pixels_uuid"}
    assert {case.name for case in VLLM_CASES} == pixels_uuid
