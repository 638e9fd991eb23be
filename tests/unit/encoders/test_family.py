"""The family table: every model type belongs to one family, each family's EPD contract is
well-formed and names only metadata its encoder emits, and a loaded encoder knows its family."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from encode_server.core.types import VideoInfo
from encode_server.encoders import FAMILIES, SUPPORTED_MODEL_TYPES, Epd, Family, load_encoder
from encode_server.encoders.family import by_model_type
from encode_server.encoders.qwen import PIXEL_SETTINGS, VIDEO_SETTINGS, load_qwen


def test_every_model_type_has_exactly_one_family() -> None:
    claimed = [t for family in FAMILIES for t in family.model_types]
    assert sorted(claimed) == sorted(SUPPORTED_MODEL_TYPES)
    assert len(set(claimed)) == len(claimed)
    assert len({family.name for family in FAMILIES}) == len(FAMILIES)


def test_a_model_type_claimed_twice_is_refused() -> None:
    a = Family("a", ("qwen2_vl",), load_qwen)
    b = Family("b", ("qwen2_vl",), load_qwen)
    with pytest.raises(ValueError, match="claimed by a and b"):
        by_model_type([a, b])


def test_an_epd_contract_is_well_formed() -> None:
    with pytest.raises(ValueError, match="mode"):
        Epd("tower")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fields"):
        Epd("pixel_free")
    assert Epd("pixels_uuid").describe() == {"mode": "pixels_uuid", "fields": {}, "tensors": {}, "vllm_model": ""}
    with pytest.raises(ValueError, match="both as JSON and as a tensor"):
        Epd("pixel_free", {"video": ("video_grid_thw",)}, tensors={"video": {"video_grid_thw": "int64"}})
    with pytest.raises(ValueError, match="tensor fields must be one of"):
        Epd("pixel_free", {"video": ("video_grid_thw",)}, tensors={"video": {"second_per_grid_ts": "bfloat16"}})
    for family in FAMILIES:
        if family.epd is not None and family.epd.mode == "pixel_free":
            assert set(family.epd.fields) <= set(family.modalities), family.name


def test_the_pixel_free_fields_are_what_the_encoder_emits(qwen_dir: Path, image: Image.Image) -> None:
    """The proxy builds a prefill item from exactly these keys of an item's ``meta``: a field the
    encoder does not emit would make every pixel-free request fail in vLLM."""
    encoder = load_encoder(str(qwen_dir), device="cpu")
    assert encoder.family is not None and encoder.family.epd is not None
    assert set(encoder.family.epd.fields["image"]) <= set(encoder.preprocess(image).meta)
    assert set(encoder.family.epd.fields["image"]) <= set(encoder.count_tokens(640, 480)[1])
    if "video" in encoder.family.epd.fields:
        plan = encoder.plan_video(VideoInfo(64, 48, 8, 4.0, "h264"), 2.0)
        assert set(encoder.family.epd.fields["video"]) <= set(plan.meta)


def test_the_builtin_model_is_a_qwen_family_model() -> None:
    encoder = load_encoder("builtin:tiny")
    assert encoder.family is not None
    assert encoder.family.describe() == {
        "name": "qwen2_vl", "modalities": ["image", "video"],
        "epd": {"mode": "pixel_free", "fields": {"image": ["image_grid_thw"], "video": ["video_grid_thw"]},
                "tensors": {"video": {"second_per_grid_ts": "float32"}}, "vllm_model": "qwen2_vl.py, qwen2_5_vl.py"},
        "settings": {name: {"type": kind, "modalities": [modality], "meaning": setting.meaning}
                     for name, kind, modality, setting in (("min_pixels", "int", "image", PIXEL_SETTINGS[0]),
                                                           ("max_pixels", "int", "image", PIXEL_SETTINGS[1]),
                                                           ("fps", "float", "video", VIDEO_SETTINGS[0]))},
    }
    # It takes what it says: a video plans from its header (the settings transformers builds a
    # Qwen2-VL video processor from when there is only the image processor's).
    plan = encoder.plan_video(VideoInfo(64, 48, 8, 4.0, "h264"), 2.0)
    assert set(encoder.family.epd.fields["video"]) <= set(plan.meta)


@pytest.mark.parametrize("name", sorted(f.name for f in FAMILIES if "video" in f.modalities))
def test_a_video_plan_says_what_decoding_it_holds(name: str, request: pytest.FixtureRequest) -> None:
    """The request-memory budget charges a video's ``VideoPlan.nbytes`` before a frame is decoded:
    every video family says it, at least the decoded frames themselves, and more for more frames."""
    from tests.tiny.records import RECORDS

    checkpoint = request.getfixturevalue(f"{RECORDS[name].kind}_dir")
    encoder = load_encoder(str(checkpoint), device="cpu")
    short, long = (encoder.plan_video(VideoInfo(64, 48, n, 4.0, "h264"), 2.0) for n in (8, 40))
    for plan in (short, long):
        assert plan.nbytes >= len(plan.indices) * 64 * 48 * 3, (name, plan)
    assert len(long.indices) > len(short.indices) and long.nbytes > short.nbytes, (name, short, long)


@pytest.mark.parametrize("name", sorted(f.name for f in FAMILIES if "image" in f.modalities))
def test_the_meta_a_family_checks_is_meta_its_encoder_emits_and_its_processor_makes(
    name: str, request: pytest.FixtureRequest, image: Image.Image
) -> None:
    """Batched preprocessing makes the grid again on the device, and ``HFEncoder`` checks it against
    what the header said for the fields the family's encoder names (``checked_meta``): no generic
    module keeps a list of family field names, and a named field is one both sides have."""
    from tests.tiny.records import RECORDS

    checkpoint = request.getfixturevalue(f"{RECORDS[name].kind}_dir")
    encoder = load_encoder(str(checkpoint), device="cpu")
    _tokens, meta = encoder.count_tokens(*image.size)
    made = set(encoder.processor(images=image, return_tensors="pt"))  # type: ignore[attr-defined]
    checked = set(encoder.checked_meta)  # type: ignore[attr-defined]
    assert checked <= set(meta) & made, (name, checked, meta, made)
    if name in ("qwen2_vl", "qwen3_vl", "glm4v", "siglip2"):  # the grids of dynamic resolution
        assert checked, name


@pytest.mark.parametrize("name", sorted(f.name for f in FAMILIES))
def test_an_encoders_kind_is_a_model_type_of_its_family(name: str, request: pytest.FixtureRequest) -> None:
    """``EncoderInfo.kind`` (in the fingerprint and ``GET /v1/model``) comes from the one registry."""
    from tests.tiny.records import RECORDS

    encoder = load_encoder(str(request.getfixturevalue(f"{RECORDS[name].kind}_dir")), device="cpu")
    assert encoder.family is not None and encoder.family.name == name
    assert encoder.info.kind in encoder.family.model_types, (name, encoder.info.kind)


# other rows for the fixture's 100x70 image: fewer (Qwen's pixels, InternVL's tiles), more (Gemma 3's crops)
_OTHER = {"max_pixels": 56 * 56, "min_patches": 1, "max_patches": 1, "do_pan_and_scan": True,
          "pan_and_scan_min_crop_size": 32}


@pytest.mark.parametrize("name", sorted(f.name for f in FAMILIES if f.settings))
def test_a_family_that_declares_settings_applies_each_as_its_processor_does(
    name: str, request: pytest.FixtureRequest, image: Image.Image
) -> None:
    """A declared key has a default from the checkpoint, and under another value the encoder's
    rows and meta are its processor's called with that value (``preprocess_with`` and
    ``count_tokens_with`` agree with each other and differ from the defaults')."""
    from tests.tiny.records import RECORDS

    encoder = load_encoder(str(request.getfixturevalue(f"{RECORDS[name].kind}_dir")), device="cpu")
    assert encoder.family is not None
    defaults = encoder.setting_defaults()
    # The checkpoint's defaults; a key the server's flag defaults (a video's fps) is not the encoder's.
    assert set(defaults) == {s.name for s in encoder.family.settings if s.server_default is None}, name
    assert encoder.count_tokens_with(*image.size, defaults) == encoder.count_tokens(*image.size)
    other = {**defaults, **{k: v for k, v in _OTHER.items() if k in defaults}}
    prepared = encoder.preprocess_with(image.convert("RGB"), other)
    counted = encoder.count_tokens_with(*image.size, other)
    assert (prepared.num_tokens, prepared.meta) == counted, name
    assert counted != encoder.count_tokens(*image.size), name


@pytest.mark.parametrize("name", sorted(f.name for f in FAMILIES if any("video" in s.modalities for s in f.settings)))
def test_a_family_that_declares_a_video_rate_samples_by_it(name: str, request: pytest.FixtureRequest) -> None:
    """The rate a request gives (its ``fps``) is the one the plan samples at: 21 frames at 6 fps
    give more frames the higher the rate, and the plan under the server's own rate is today's."""
    from tests.tiny.records import RECORDS

    encoder = load_encoder(str(request.getfixturevalue(f"{RECORDS[name].kind}_dir")), device="cpu")
    if encoder.video is None:  # type: ignore[attr-defined]
        pytest.skip(f"{name}'s test checkpoint has no video processor")
    info = VideoInfo(56, 56, 21, 6.0, "h264")
    frames = {fps: len(encoder.plan_video(info, fps).indices) for fps in (1.0, 2.0, 4.0)}
    print(f"\n{name}: frames sampled per rate {frames}")
    assert frames[1.0] < frames[2.0] < frames[4.0], frames
