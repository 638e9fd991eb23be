"""``encode_client.config_layout``, the one table of where a checkpoint's config keeps its towers'
configs and DeepStack levels, read by the vLLM connector and by the server's family modules alike:
checked against every family ``encoders.FAMILIES`` serves, on its real tiny checkpoints, so that
neither reader can size or find what the other does not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from encode_client.config_layout import (
    CONFIG_LAYOUTS,
    PLAIN,
    deepstack_levels,
    layout_of,
    towers_config,
    vision_config,
)
from PIL import Image
from transformers import AutoConfig

from encode_server.encoders import FAMILIES, SUPPORTED_MODEL_TYPES, EncodedTensor, load_encoder
from tests.tiny.records import RECORDS
from tests.unit.encoders.util import decode

# (family, model type) for every model type of every family that has a tiny checkpoint
CASES = [(family.name, kind) for family in FAMILIES for kind in family.model_types
         if kind in RECORDS[family.name].builders]


def test_every_family_has_a_case() -> None:
    assert {name for name, _ in CASES} == {family.name for family in FAMILIES}


def test_the_table_names_only_model_types_the_server_serves() -> None:
    assert set(CONFIG_LAYOUTS) <= set(SUPPORTED_MODEL_TYPES), sorted(set(CONFIG_LAYOUTS) - set(SUPPORTED_MODEL_TYPES))


def test_a_model_type_the_table_does_not_list_has_the_plain_layout() -> None:
    config = {"model_type": "not_a_family", "vision_config": {"deepstack_visual_indexes": [0, 1]}}
    assert layout_of("not_a_family") == layout_of(None) == PLAIN
    assert towers_config(config) is config and vision_config(config) == config["vision_config"]
    assert deepstack_levels(config) == ()  # only the table says a family packs DeepStack rows


def test_a_sub_config_given_directly_is_its_own_towers_config() -> None:
    """A reader handed a thinker's config itself (not the checkpoint's) still finds its towers."""
    thinker_layouts = [kind for kind, layout in CONFIG_LAYOUTS.items() if layout.towers]
    assert thinker_layouts
    for kind in thinker_layouts:
        inner = {"vision_config": {"out_hidden_size": 8}}
        assert layout_of(kind).towers_of(inner) is inner


def _language_width(towers: Any) -> int | None:
    text = getattr(towers, "text_config", None)
    return None if text is None else int(text.hidden_size)


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_the_table_and_the_family_module_agree_on_a_real_checkpoint(
    name: str, kind: str, request: pytest.FixtureRequest, image: Image.Image
) -> None:
    """Where the table finds the towers' configs is where the family's modalities are; its
    DeepStack levels are what the family's encoder packs: each row is ``1 + levels`` language model
    widths (vLLM's encoder output, what the connector checks); the ``config.json`` read as JSON
    gives the same levels as the config object vLLM and transformers build."""
    family = next(f for f in FAMILIES if f.name == name)
    checkpoint: Path = request.getfixturevalue(f"{kind}_dir")
    config = AutoConfig.from_pretrained(checkpoint)
    raw = json.loads((checkpoint / "config.json").read_text())
    assert config.model_type == raw["model_type"] == kind
    levels = deepstack_levels(config)
    assert deepstack_levels(raw) == levels, (kind, raw)
    towers = towers_config(config)
    assert (vision_config(config) is not None) == ("image" in family.modalities), (kind, type(towers).__name__)
    assert (getattr(towers, "audio_config", None) is not None) == ("audio" in family.modalities), kind
    if layout_of(kind).deepstack:
        assert levels, f"{kind}'s tiny checkpoint exercises no DeepStack level"
    encoder = load_encoder(str(checkpoint), device="cpu")
    width = _language_width(towers)
    if family.epd is None:  # nothing the connector consumes: no DeepStack to agree on
        assert levels == (), kind
        return
    assert width is not None, f"{kind}: no text_config where the table puts the towers"
    assert encoder.info.hidden_size == (1 + len(levels)) * width, (kind, encoder.info.hidden_size, levels, width)
    if "image" in family.modalities:  # what the tower emits, not only what the encoder says it emits
        [encoded] = encoder.forward([encoder.preprocess(image.convert("RGB"))])
        assert isinstance(encoded, EncodedTensor), encoded
        assert decode(encoded).shape[-1] == (1 + len(levels)) * width, (kind, levels, width)


def test_the_table_imports_neither_torch_nor_transformers_nor_the_server() -> None:
    """The connector and the torch-free client read it too."""
    code = ("import sys, encode_client.config_layout; "
            "bad = sorted(m for m in ('torch', 'transformers', 'vllm', 'encode_server') if m in sys.modules); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
