"""One record per model family for the server's tests: what each family's tiny checkpoints are and
how its full model's features are computed. The tables the tests run over are derived from these
records (``tests/unit/encoders/conftest.py``'s ``<kind>_dir`` fixtures, the cases of
``tests/integration/test_families.py``), and ``tests/unit/encoders/test_records.py`` fails when
``encoders.FAMILIES`` has a family without a record, or a record a model type its family does not
serve. The vLLM suite's records (``tests/vllm/families.py``: vLLM-ready builders, prompts, sizes)
are checked against ``encoders.FAMILIES`` in their own modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests import tiny_models
from tests.tiny.gemma3 import make_tiny_gemma3
from tests.tiny.gemma4 import make_tiny_gemma4
from tests.tiny.glm4v import make_tiny_glm4v
from tests.tiny.internvl import make_tiny_internvl
from tests.tiny.kimi_k25 import make_tiny_kimi_k25
from tests.tiny.llama4 import make_tiny_llama4
from tests.tiny.llava_next import make_tiny_llava_next
from tests.tiny.llava_onevision import make_tiny_llava_onevision
from tests.tiny.mistral3 import make_tiny_mistral3
from tests.tiny.qwen2_5_omni import make_tiny_qwen2_5_omni
from tests.tiny.qwen2_audio import make_tiny_qwen2_audio
from tests.tiny.qwen3_omni import make_tiny_qwen3_omni

__all__ = ["RECORDS", "Builder", "TinyFamily", "builder"]

Builder = Callable[[Path], Path]


@dataclass(frozen=True)
class TinyFamily:
    name: str  # the family's name in encoders.FAMILIES (what GET /v1/model publishes)
    # model_type -> its tiny full checkpoint; the first is the one the per-family tests serve.
    builders: dict[str, Builder]
    # How tests/integration/test_families.py (an image family) or test_audio.py (an audio family)
    # computes the full model's features for one item.
    reference: str
    # Whether the token count varies with the image (False: a fixed-resolution family, one N).
    variable_tokens: bool

    @property
    def kind(self) -> str:
        """The model type the per-family tests serve."""
        return next(iter(self.builders))


def _qwen3(kind: str) -> Builder:
    return lambda directory: tiny_models.make_qwen3(directory, kind)


RECORDS: dict[str, TinyFamily] = {
    record.name: record
    for record in (
        TinyFamily("clip", {"clip": lambda d: tiny_models.make_clip(d, kind="clip"),
                            "siglip": lambda d: tiny_models.make_clip(d, kind="siglip")}, "clip", False),
        TinyFamily("siglip2", {"siglip2": lambda d: tiny_models.make_clip(d, kind="siglip2")}, "clip", True),
        TinyFamily("llava", {"llava": tiny_models.make_llava}, "llava", False),
        TinyFamily("qwen2_vl", {"qwen2_5_vl": tiny_models.make_qwen2_5_vl, "qwen2_vl": tiny_models.make_qwen2_vl},
                   "qwen", True),
        TinyFamily("qwen3_vl", {kind: _qwen3(kind) for kind in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")},
                   "qwen3", True),
        TinyFamily("internvl", {"internvl": make_tiny_internvl}, "internvl", True),
        TinyFamily("llama4", {"llama4": make_tiny_llama4}, "llama4", True),
        TinyFamily("kimi_k25", {"kimi_k25": make_tiny_kimi_k25}, "kimi_k25", True),
        TinyFamily("gemma3", {"gemma3": make_tiny_gemma3}, "gemma3", False),
        TinyFamily("gemma4", {"gemma4": make_tiny_gemma4}, "gemma4", True),
        TinyFamily("mistral3", {"mistral3": make_tiny_mistral3}, "mistral3", True),
        TinyFamily("glm4v", {"glm4v": make_tiny_glm4v}, "qwen", True),  # the same get_image_features and meta
        TinyFamily("llava_next", {"llava_next": make_tiny_llava_next}, "anyres", True),
        TinyFamily("llava_onevision", {"llava_onevision": make_tiny_llava_onevision}, "anyres", True),
        TinyFamily("qwen2_audio", {"qwen2_audio": make_tiny_qwen2_audio}, "qwen2_audio", True),  # audio only
        # images, videos and audio: in test_families.py and test_audio.py both
        TinyFamily("qwen2_5_omni", {"qwen2_5_omni": make_tiny_qwen2_5_omni}, "qwen2_5_omni", True),
        TinyFamily("qwen3_omni", {"qwen3_omni_moe": make_tiny_qwen3_omni}, "qwen3_omni", True),
    )
}


def builder(kind: str) -> Builder:
    """The tiny checkpoint builder of a model type, whichever family serves it."""
    for record in RECORDS.values():
        if kind in record.builders:
            return record.builders[kind]
    raise KeyError(f"no tiny checkpoint for model type {kind!r} in tests/tiny/records.py")
