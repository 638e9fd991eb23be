"""Where a checkpoint's config keeps what the towers' rows depend on, per ``model_type``: one table.

Two readers need the same facts about a checkpoint's ``config.json``, and must never disagree:
encode-server's family modules (``encode_server.encoders``), which build the towers and size their
rows, and the vLLM EC connector (``encode_client.vllm_connector``), which runs inside vLLM with
only vLLM's copy of that config (its ``hf_config``) and may never reach the server (a connector
given ``fingerprint`` alone has no ``GET /v1/model`` to ask). So the layout lives here, in the
client package both import (the server imports the client package, never the other way), and
each reader asks it instead of naming a family's fields:

- ``towers``: the sub-config that holds the towers' configs (``vision_config``, ``audio_config``,
  ``text_config``); None where they sit at the top level. An Omni checkpoint keeps them under its
  thinker's config, beside the talker's.
- ``deepstack``: the vision config's field that lists the blocks whose features are packed after
  the main merger's on the last dimension (DeepStack), each one more language-model width; None
  where the rows are the merger's alone.

A ``model_type`` absent from the table has the plain layout (``PLAIN``: towers at the top level,
no DeepStack), so a new family whose layout is plain needs no line here.
``tests/unit/client/test_config_layout.py`` checks the table against every family the server
serves, on real tiny checkpoints: each encoder's rows are ``1 + len(deepstack_levels)`` language
model widths wide, the towers' configs are where the table says, and every key is a served type.

Configs are read by attribute (a transformers or vLLM ``PretrainedConfig``) or by key (the JSON of
a ``config.json``), so the table needs neither transformers nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["CONFIG_LAYOUTS", "PLAIN", "ConfigLayout", "deepstack_levels", "layout_of", "towers_config",
           "vision_config"]


def _field(config: Any, name: str) -> Any:
    """``config``'s ``name``, read from a config object or a ``config.json`` mapping; None if absent."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


@dataclass(frozen=True)
class ConfigLayout:
    """Where one family's config keeps its towers' configs and its DeepStack levels (module docstring)."""

    towers: str | None = None
    deepstack: str | None = None

    def towers_of(self, config: Any) -> Any:
        """The config that holds the towers' configs: ``towers`` of ``config``, or ``config`` itself
        when the layout has none (or ``config`` is already that sub-config)."""
        if self.towers is None:
            return config
        inner = _field(config, self.towers)
        return config if inner is None else inner

    def vision_of(self, config: Any) -> Any:
        """The checkpoint's vision config, or None (an audio-only model, a bare vision tower)."""
        return _field(self.towers_of(config), "vision_config")

    def deepstack_levels(self, vision: Any) -> tuple[int, ...]:
        """The blocks whose features a vision config's rows pack after the main ones: ``()`` for a
        layout without DeepStack or a vision config without the field."""
        if self.deepstack is None or vision is None:
            return ()
        return tuple(int(level) for level in _field(vision, self.deepstack) or ())


PLAIN = ConfigLayout()
_DEEPSTACK = ConfigLayout(deepstack="deepstack_visual_indexes")
_THINKER = ConfigLayout(towers="thinker_config")

CONFIG_LAYOUTS: Mapping[str, ConfigLayout] = MappingProxyType({
    "qwen3_vl": _DEEPSTACK,
    "qwen3_vl_moe": _DEEPSTACK,
    "qwen2_5_omni": _THINKER,
    "qwen3_omni_moe": ConfigLayout(towers=_THINKER.towers, deepstack=_DEEPSTACK.deepstack),
})


def layout_of(model_type: str | None) -> ConfigLayout:
    """The layout of a checkpoint of ``model_type`` (``PLAIN`` for a type the table does not list)."""
    return CONFIG_LAYOUTS.get(model_type or "", PLAIN)


def towers_config(config: Any) -> Any:
    """The config holding a checkpoint's towers' configs (its ``model_type`` picks the layout)."""
    return layout_of(_field(config, "model_type")).towers_of(config)


def vision_config(config: Any) -> Any:
    """A checkpoint's vision config, wherever its family keeps it; None if it has none."""
    return layout_of(_field(config, "model_type")).vision_of(config)


def deepstack_levels(config: Any) -> tuple[int, ...]:
    """The DeepStack levels of a checkpoint's vision rows (``()``: its rows are the merger's alone)."""
    layout = layout_of(_field(config, "model_type"))
    return layout.deepstack_levels(layout.vision_of(config))
