"""The end-to-end benchmark's request streams: seeded JSONL files for ``vllm bench serve``.

Each workload is a ``custom_image`` dataset (one user message per line: the image, then the text;
``--custom-ensure-client-side-data`` sends each image as a base64 data URL, as an application
would) over JPEG images of mixed sizes (448x448 up to 1280x720, Qwen-typical inputs), smooth
enough to weigh what photos weigh:

- ``unique``: every request a new image (nothing to reuse anywhere);
- ``popular``: requests over a catalogue a quarter their number, drawn Zipf (s = 1): a few hot
  images, as memes and shared documents are, each asked a different question;
- ``multiturn``: conversations of ``turns`` turns that re-send their image with a growing history
  (questions and made-up answers), interleaved so each turn comes after the others' same turn.

The order is the file's (the bench passes ``--disable-shuffle``); ``requests`` gives what
``bench/flops.py`` needs to state the tower's share of each workload.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.flops import Request
from tests.vllm.tiny_qwen import WORDS  # words its tokenizer knows, so prompts are real tokens

__all__ = ["SIZES", "WORKLOADS", "Workload", "write_workloads"]

SIZES = ((448, 448), (640, 480), (960, 540), (1280, 720))
WORKLOADS = ("unique", "popular", "multiturn")
TEMPLATE_TOKENS = 8  # the chat template's tokens around one user message (role markers, newlines)


@dataclass
class Workload:
    name: str
    path: Path
    requests: list[Request] = field(default_factory=list)
    images: int = 0  # distinct images in the stream


def _jpeg(path: Path, width: int, height: int, seed: int) -> None:
    """A smooth random picture (a coarse random field, upsampled, a little grain), saved as JPEG."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    field = Image.fromarray((rng.random((6, 8, 3)) * 255).astype("uint8"))
    coarse = field.resize((width, height), Image.Resampling.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (height, width, 3))
    Image.fromarray(pixels.clip(0, 255).astype("uint8")).save(path, format="JPEG", quality=88)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _line(image: Path, text: str) -> str:
    content = [{"type": "image_url", "image_url": {"url": str(image)}}, {"type": "text", "text": text}]
    return json.dumps({"content": content})


def write_workloads(directory: Path, prompts: int, output_tokens: int, seed: int = 0, turns: int = 4,
                    question_words: int = 32) -> dict[str, Workload]:
    """Write every workload's images and JSONL under ``directory``; ``prompts`` requests each."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    made: dict[str, Workload] = {}
    serial = 0

    def image(tag: str) -> tuple[Path, tuple[int, int]]:
        nonlocal serial
        serial += 1
        size = SIZES[rng.randrange(len(SIZES))]
        path = directory / f"{tag}-{serial:04d}.jpg"
        _jpeg(path, *size, seed=seed * 100_003 + serial)
        return path, size

    def add(workload: Workload, lines: list[str], img: tuple[Path, tuple[int, int]], text: str) -> None:
        lines.append(_line(img[0], text))
        workload.requests.append(Request(*img[1], len(text.split()) + TEMPLATE_TOKENS, output_tokens))

    for name in WORKLOADS:
        workload = Workload(name, directory / f"{name}.jsonl")
        lines: list[str] = []
        if name == "unique":
            for _ in range(prompts):
                add(workload, lines, image("u"), _sentence(rng, question_words))
            workload.images = prompts
        elif name == "popular":
            catalogue = [image("p") for _ in range(max(1, prompts // 4))]
            weights = [1.0 / (k + 1) for k in range(len(catalogue))]
            drawn = rng.choices(range(len(catalogue)), weights=weights, k=prompts)
            for k in drawn:
                add(workload, lines, catalogue[k], _sentence(rng, question_words))
            workload.images = len(set(drawn))
        else:
            conversations = max(1, prompts // turns)
            pictures = [image("m") for _ in range(conversations)]
            history = [""] * conversations
            for _ in range(turns):
                for c in range(conversations):
                    if len(lines) == prompts:
                        break
                    question = _sentence(rng, question_words // 2)
                    text = f"{history[c]} {question}".strip()
                    add(workload, lines, pictures[c], text)
                    history[c] = f"{text} {_sentence(rng, 16)}"  # the answer, as a client keeps it
            workload.images = conversations
        workload.path.write_text("\n".join(lines) + "\n")
        made[name] = workload
    return made
