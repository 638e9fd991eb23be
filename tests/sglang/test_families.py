"""Every family SGLang's language-only prefill takes from encode-server (the families whose module
declares ``Family.sglang``, in ``encoders.FAMILIES``), each modality it declares: SGLang 0.5.23's
receiver, with the family's own processor built from its tiny checkpoint (the vLLM suite's, with its
tokenizer and processor config), takes a request from a real encode-server (``--sglang``) through
``zmq_to_tokenizer``; the rows it lays into the prompt are encode-server's ``/v1/encode`` rows, and
``get_validated_mm_data`` passes (one placeholder row per embedding row, every row consumed)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from encode_server.encoders import FAMILIES
from tests.audios import make_audio
from tests.sglang.conftest import SGLANG_FLAGS, data_uri, image_item, png
from tests.sglang.oracle import encode_rows, placeholder_id, prompt_for
from tests.sglang.prefill import Prefill, modality_rows
from tests.videos import make_video
from tests.vllm.families import PROXY_CASES

SGLANG_FAMILIES = {family.name: family for family in FAMILIES if family.sglang is not None}
CASES = [pytest.param(name, modality, id=f"{name}-{modality}")
         for name, family in SGLANG_FAMILIES.items() for modality in family.sglang.modalities]  # type: ignore[union-attr]


def _items(modality: str) -> list[bytes]:
    if modality == "image":
        return [png(96, 64, seed=50), png(56, 120, seed=51)]
    if modality == "video":
        return [make_video(8, 4.0, 64, 48, seed=5)]
    return [make_audio(1.5, 16_000, seed=5)]


_MIMES = {"image": "image/png", "video": "video/mp4", "audio": "audio/wav"}

# What SGLang reads of a real checkpoint that the tiny one (built for vLLM, without remote code) names
# otherwise. Kimi-K2.5 runs on its remote code (--trust-remote-code): its config's
# media_placeholder_token_id (the tiny config's image_token_id), and its processor's media_processor (the
# image processor, whose media_proc_cfg the tiny checkpoint saves; transformers' own Kimi_K25Processor
# calls it image_processor).
_SGLANG_CONFIG_KEYS = {"kimi_k25": {"media_placeholder_token_id": "image_token_id"}}
_SGLANG_PROCESSOR_ALIASES = {"kimi_k25": ("transformers.Kimi_K25Processor", "media_processor", "image_processor")}


def _sglang_checkpoint(name: str, checkpoint: Path) -> Path:
    keys = _SGLANG_CONFIG_KEYS.get(name)
    if not keys:
        return checkpoint
    copy = checkpoint.with_name(checkpoint.name + "-sglang")
    if not copy.exists():
        shutil.copytree(checkpoint, copy)
        config = json.loads((copy / "config.json").read_text())
        config.update({key: config[source] for key, source in keys.items()})
        (copy / "config.json").write_text(json.dumps(config, indent=2))
    return copy


class _OneFamilyAtATime:
    """Each family's encode-server, started for its first case and stopped when the next family's starts."""

    def __init__(self, root: Path, logs: Path) -> None:
        self.root, self.logs = root, logs
        self.name: str | None = None
        self.server: Any = None
        self.checkpoint: Path | None = None

    def get(self, name: str) -> tuple[Path, Any]:
        from tests.server import start_server

        if name != self.name:
            self.close()
            self.checkpoint = PROXY_CASES[name].build(self.root / name)
            self.server = start_server("--model", str(self.checkpoint), "--grpc-port", "0", *SGLANG_FLAGS,
                                       log_dir=self.logs, python=os.environ["ENCODE_SERVER_PYTHON"])
            self.name = name
        assert self.checkpoint is not None
        return self.checkpoint, self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.name = self.server = None


@pytest.fixture(scope="module")
def family_servers(tmp_path_factory: pytest.TempPathFactory, logs: Path) -> Iterator[_OneFamilyAtATime]:
    servers = _OneFamilyAtATime(tmp_path_factory.mktemp("families"), logs)
    yield servers
    servers.close()


def test_the_cases_cover_the_families_the_code_publishes() -> None:
    assert {"qwen2_vl", "qwen3_vl", "kimi_k25"} <= set(SGLANG_FAMILIES), sorted(SGLANG_FAMILIES)
    assert all(name in PROXY_CASES for name in SGLANG_FAMILIES), "a family without a tiny SGLang-loadable checkpoint"


@pytest.mark.parametrize(("name", "modality"), CASES)
def test_a_familys_items_land_as_encode_servers_rows(
    family_servers: _OneFamilyAtATime, prefill_of: Any, monkeypatch: pytest.MonkeyPatch, name: str, modality: str
) -> None:
    checkpoint, server = family_servers.get(name)
    if name in _SGLANG_PROCESSOR_ALIASES:
        where, alias, attr = _SGLANG_PROCESSOR_ALIASES[name]
        module, cls = where.rsplit(".", 1)
        monkeypatch.setattr(getattr(importlib.import_module(module), cls), alias,
                            property(lambda self: getattr(self, attr)), raising=False)
    # A family SGLang cannot start a language-only prefill for fails here (as Qwen2.5-Omni did: SGLang
    # 0.5.23 has no model or processor for it): it must then declare no contract.
    prefill: Prefill = prefill_of(_sglang_checkpoint(name, checkpoint), [server.url])
    seen: dict[str, Any] = {}  # what SGLang's receiver hands the processor besides the rows
    validate = prefill.mm_processor.get_validated_mm_data

    def recording(prompt: Any, embeddings: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return validate(prompt, embeddings, **kwargs)

    monkeypatch.setattr(prefill.mm_processor, "get_validated_mm_data", recording)
    datas = _items(modality)
    counts = {f"{modality}s": len(datas)}
    prompt = prompt_for(prefill.tokenizer, prefill.hf_config, **counts)
    items = [image_item(d) for d in datas] if modality == "image" else [data_uri(d, _MIMES[modality]) for d in datas]
    received = prefill.receive(prompt, **{f"{modality}s": items})
    output = received.output
    got = modality_rows(output)[modality]
    answers = [encode_rows(server.url, d, modality) for d in datas]
    expected = torch.cat([rows for rows, _ in answers])
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert sum(1 for t in output.input_ids if t == placeholder_id(prefill.hf_config, modality)) == expected.shape[0]
    # the grids and the family's extras SGLang read are the items' meta (or SGLang's own default)
    contract = SGLANG_FAMILIES[name].sglang
    assert contract is not None
    grids = [meta[contract.grids[modality]] for _, meta in answers]
    assert seen[_GRID_KWARGS[modality]].flatten().tolist() == torch.tensor(grids).flatten().tolist()
    for extra in contract.extras.get(modality, ()):
        want = [meta.get(extra.meta_key, extra.default) for _, meta in answers]
        assert extra.attr in seen, f"SGLang's receiver got no {extra.attr}"
        if extra.kind == "float32":
            assert [float(v) for v in seen[extra.attr]] == torch.tensor(want, dtype=torch.float32).tolist()
        else:
            assert [[float(t) for t in v] for v in seen[extra.attr]] == [[float(t) for t in v] for v in want]


# What SGLang's part collection hands the processor a modality's grids as (get_mm_extra_meta).
_GRID_KWARGS = {"image": "img_grid_thw", "video": "video_grid_thw", "audio": "audio_feature_lens"}
