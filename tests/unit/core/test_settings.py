"""Per-request processor settings: what a request may ask, and how its settings are named."""

from __future__ import annotations

from typing import Any

import pytest

from encode_server.core.errors import BadInput
from encode_server.core.settings import Setting, describe, digest, resolve

DECLARED = (
    Setting("min_pixels", "int", "pixel floor", minimum=1, cap="max_image_pixels"),
    Setting("max_pixels", "int", "pixel ceiling", minimum=1, cap="max_image_pixels"),
    Setting("do_pan_and_scan", "bool", "crops"),
    Setting("fps", "float", "frame rate", minimum=0.1, maximum=30, modalities=("video",)),
    Setting("max_patches", "int", "tiles", minimum=1, ceiling="max_patches"),
)
DEFAULTS: dict[str, Any] = {"min_pixels": 3136, "max_pixels": 200704, "do_pan_and_scan": False, "fps": 2.0,
                            "max_patches": 12}
LIMITS = {"max_image_pixels": 1_000_000}


def _resolve(given: Any, modality: str = "image") -> dict[str, Any] | None:
    return resolve(DECLARED, DEFAULTS, given, LIMITS, modality)


def test_nothing_given_and_the_defaults_written_out_both_resolve_to_none_so_keys_stay_todays() -> None:
    assert _resolve(None) is None and _resolve({}) is None
    assert _resolve({"max_pixels": 200704, "do_pan_and_scan": False}) is None


def test_the_effective_settings_fill_in_the_defaults_of_the_items_modality_only() -> None:
    assert _resolve({"max_pixels": 12544}) == {"min_pixels": 3136, "max_pixels": 12544, "do_pan_and_scan": False,
                                               "max_patches": 12}
    assert _resolve({"fps": 1}, "video") == {"fps": 1.0}


def test_one_setting_written_two_ways_gets_one_digest_and_two_settings_two() -> None:
    a = _resolve({"max_pixels": 12544, "min_pixels": 3136})
    b = _resolve({"min_pixels": 3136, "max_pixels": 12544})
    c = _resolve({"max_pixels": 12545})
    assert a is not None and b is not None and c is not None
    assert digest(a) == digest(b) != digest(c)
    assert len(digest(a)) == 64


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"max_pixel": 1}, "max_pixel is not a setting"),
        ({"max_pixels": "12544"}, "max_pixels must be an integer"),
        ({"max_pixels": 12544.0}, "max_pixels must be an integer"),
        ({"max_pixels": True}, "max_pixels must be an integer"),
        ({"do_pan_and_scan": 1}, "do_pan_and_scan must be true or false"),
        ({"max_pixels": 0}, "max_pixels must be at least 1"),
        ({"max_pixels": 1_000_001}, "at most 1e\\+06 \\(--max-image-pixels\\)"),
        ({"fps": 2}, "fps does not apply to an image"),
        ({"max_patches": 13}, "max_patches must be at least 1 and at most 12 \\(the checkpoint.s max_patches\\)"),
        ([1, 2], "must be an object"),
    ],
)
def test_an_unknown_key_a_wrong_type_or_an_out_of_range_value_is_bad_input_naming_the_key(
    given: Any, words: str
) -> None:
    with pytest.raises(BadInput, match=words) as caught:
        _resolve(given)
    assert caught.value.type == "invalid_setting"


def test_a_float_out_of_range_or_nan_is_refused() -> None:
    for value in (31.0, 0.0, float("nan")):
        with pytest.raises(BadInput, match="fps must be"):
            _resolve({"fps": value}, "video")


def test_the_published_bounds_are_capped_by_the_servers_limits() -> None:
    published = describe(DECLARED, DEFAULTS, LIMITS)
    assert published["max_pixels"]["maximum"] == 1_000_000 and published["max_pixels"]["default"] == 200704
    assert published["fps"]["maximum"] == 30 and published["fps"]["modalities"] == ["video"]
    assert published["max_patches"]["maximum"] == 12  # no request asks for more than the defaults' worst case


def test_an_exclusive_minimum_refuses_the_bound_itself_and_is_published_with_vllms_field() -> None:
    rate = Setting("fps", "float", "frame rate", above=0, maximum=30, modalities=("video",),
                   vllm_field="media_io_kwargs.video")
    assert resolve((rate,), {"fps": 2.0}, {"fps": 0.01}, LIMITS, "video") == {"fps": 0.01}
    for value in (0, -1.0):
        with pytest.raises(BadInput, match="fps must be above 0 and at most 30"):
            resolve((rate,), {"fps": 2.0}, {"fps": value}, LIMITS, "video")
    published = describe((rate,), {"fps": 2.0}, LIMITS)["fps"]
    assert (published["exclusive_minimum"], published["vllm_field"]) == (0, "media_io_kwargs.video")
    assert describe(DECLARED, DEFAULTS, LIMITS)["max_pixels"]["vllm_field"] == "mm_processor_kwargs"
