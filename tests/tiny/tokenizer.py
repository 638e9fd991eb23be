"""A word-level tokenizer with a family's special tokens: prompts, placeholders and greedy token
ids behave as with the real model's tokenizer (the words mean nothing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_TEXT = (
    "user assistant system describe the image what is in this picture a an of and to it you are helpful "
    "cat dog red blue green sky tree house car person one two three four five six seven eight nine ten "
    "hello world please tell me about colour shape big small left right top bottom yes no"
)
WORDS = _TEXT.split(" ")


def word_tokenizer(
    special: Sequence[str],
    *,
    vocab_size: int = 256,
    named: Mapping[str, str] | None = None,
    chat_template: str | None = None,
    **tokens: str,
) -> Any:
    """A ``PreTrainedTokenizerFast`` of ``vocab_size`` ids: ``<unk>``, the words, fillers, then
    ``special`` (each one id, never split). ``named``: model-specific token attributes (e.g.
    InternVL's ``context_image_token``); ``tokens``: ``eos_token``, ``pad_token``, ``bos_token``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", *WORDS]
    words += [f"w{i}" for i in range(vocab_size - len(special) - len(words))]
    vocab = {w: i for i, w in enumerate([*words, *special])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra: Any = dict(named) if named else list(special)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", extra_special_tokens=extra, **tokens
    )
    if named:
        tokenizer.add_special_tokens({"extra_special_tokens": list(special)}, replace_extra_special_tokens=False)
    tokenizer.chat_template = chat_template
    return tokenizer


def token_ids(tokenizer: Any, special: Sequence[str]) -> dict[str, int]:
    return {t: int(tokenizer.convert_tokens_to_ids(t)) for t in special}


def randomize(model: Any, seed: int, std: float = 0.2) -> None:
    """Every matrix (and every zero-initialised embedding: CLS tokens, position tables, image
    projections) drawn from N(0, std): transformers initialises some of them to zero, and a tiny
    random model would then embed every image alike. Larger than default weights so that greedy
    tokens depend visibly on the image embedding."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "embedding" in name or "cls_token" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
