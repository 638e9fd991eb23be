"""The memory a tower-free prefill frees, measured: vLLM with ``--load-format dummy`` on a real
model's config, with its tower and without (its modalities' ``--limit-mm-per-prompt`` at 0), on
this machine. Three cases (``--case``):

- ``qwen2_5_vl_3b`` (the default): Qwen2.5-VL-3B-Instruct's ``config.json``, the real 32-block,
  1280-wide vision tower and merger, the real 2048-wide language model and 151,936-token vocabulary;
- ``qwen2_audio_7b``: Qwen2-Audio-7B-Instruct's, the real Whisper-large audio encoder (32 layers,
  1,280 wide, 128 mel bins) and its projector, the real 4096-wide language model (32 KV heads) and
  156,032-token vocabulary: the audio tower a tower-free audio prefill drops;
- ``qwen2_5_omni_7b``: Qwen2.5-Omni-7B's thinker (vLLM's ``Qwen2_5OmniThinkerForConditionalGeneration``,
  saved as the project's tiny Omni is: the whole ``qwen2_5_omni`` config, ``Qwen2_5OmniModel``): the
  real 32-block, 1280-wide vision tower and merger (to 3,584), the real Whisper-large-like audio
  encoder (32 layers, 1,280 wide, 128 mel bins, projected to 3,584), the real 3584-wide language
  model (4 KV heads, 152,064-token vocabulary, untied): both towers, which a tower-free prefill
  (image, video and audio limits 0) drops together.

Each is written here, offline (the tokenizer and processor files are the case's tiny test model's,
which is all a dummy load reads besides the config), with ``--layers`` of its decoder layers
(default 8 for the 3B, 2 for the 7Bs: the whole models in bfloat16 are 7.5, 15.6 and 17.8 GB of
weights, more than this shared machine may spend; the towers are always whole). Each run is a fresh process
(the engine in-process) that reports:

- its weights: every parameter vLLM built, in bytes, and those of the tower (the case's prefixes);
- its resident memory: peak (``VmHWM``) and after start-up;
- its KV cache: vLLM's CPU backend sizes it as ``--gpu-memory-utilization`` x the machine's memory
  minus what the process holds once loaded (``vllm/v1/worker/cpu_worker.py``), the same budget
  arithmetic as on a GPU, so the memory the tower does not take becomes KV blocks; set here so
  that the budget is ``--budget-gib``.

The arithmetic for the whole model follows from the config: parameter counts (checked against
what vLLM built for the measured one), KV bytes per token (2 x layers x KV heads x head size x 2
bytes), and an H200 at ``--gpu-memory-utilization 0.9``. On a GPU vLLM also profiles the encoder
on its largest input and reserves that activation peak; a tower-free engine skips the run (vLLM's
CPU backend runs no profile in eager mode, so that share is not measured here).

Run: ``python -m bench.tower_memory [--case qwen2_audio_7b|qwen2_5_omni_7b]`` (needs the vLLM test
environment, ``make vllm-env``; it checks free memory first and stops a run whose memory passes
``--cap-gib``). Writes ``bench/results/tower_memory.json`` (``tower_memory_audio.json`` for the audio
case, ``tower_memory_omni.json`` for the Omni) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GIB = 1 << 30
H200_BYTES = 143_771 * (1 << 20)  # what nvidia-smi reports for an H200 (141 GB HBM3e)

# Qwen/Qwen2.5-VL-3B-Instruct's config.json (the architecture fields; token ids are the tiny
# tokenizer's, see make_config).
QWEN2_5_VL_3B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 11008,
    "num_hidden_layers": 36,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
}


# Qwen/Qwen2-Audio-7B-Instruct's config.json: the Whisper-large audio encoder and a Qwen2 language
# model with transformers' Qwen2 defaults where the file leaves them out (4096 wide, 32 layers, 32
# heads, 32 KV heads, untied embeddings); token ids are the tiny tokenizer's, see make_config.
QWEN2_AUDIO_7B: dict[str, Any] = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "model_type": "qwen2_audio",
    "audio_config": {
        "model_type": "qwen2_audio_encoder", "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120, "d_model": 1280, "activation_function": "gelu", "scale_embedding": False,
        "max_source_positions": 1500,
    },
    "text_config": {
        "model_type": "qwen2", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 8192,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": False, "vocab_size": 156032, "torch_dtype": "bfloat16",
    },
    "torch_dtype": "bfloat16",
}


# Qwen/Qwen2.5-Omni-7B's thinker, saved as the project's tiny Omni is (tests/tiny/qwen2_5_omni.py: the
# whole Qwen2_5OmniConfig, no talker), the sizes transformers' Qwen2_5OmniThinkerConfig defaults to
# (its sub-configs' defaults are the 7B's) except the vision width: the class defaults
# ``hidden_size`` to 3584 (the language model's) where the 7B's tower is 1,280 wide
# (``intermediate_size`` 3420 and 16 heads are a 1280-wide Qwen2.5-VL tower's); ``tokens_per_second``
# is vLLM's fallback (the class has the thinker's ``position_id_per_seconds``, 25), and the language
# model is untied (Qwen2.5-7B's lm_head is its own; the text class defaults to tied). Token ids are
# the tiny tokenizer's, see make_config.
QWEN2_5_OMNI_7B: dict[str, Any] = {
    "architectures": ["Qwen2_5OmniModel"],
    "model_type": "qwen2_5_omni",
    "enable_audio_output": False,
    "thinker_config": {
        "model_type": "qwen2_5_omni_thinker",
        "audio_config": {
            "model_type": "qwen2_5_omni_audio_encoder", "num_mel_bins": 128, "encoder_layers": 32,
            "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "d_model": 1280, "activation_function": "gelu",
            "scale_embedding": False, "max_source_positions": 1500, "n_window": 100, "output_dim": 3584,
        },
        "vision_config": {
            "model_type": "qwen2_5_omni_vision_encoder", "depth": 32, "hidden_act": "silu", "hidden_size": 1280,
            "intermediate_size": 3420, "num_heads": 16, "in_channels": 3, "out_hidden_size": 3584, "patch_size": 14,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 25,
        },
        "text_config": {
            "model_type": "qwen2_5_omni_text", "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "sliding_window": 32768,
            "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
            "vocab_size": 152064,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        },
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
    },
    "torch_dtype": "bfloat16",
}


def thinker_config(config: dict[str, Any]) -> dict[str, Any]:
    """The multimodal model's fields: the config itself or (Qwen2.5-Omni) its ``thinker_config``,
    where the family table says its towers live (``encode_client.config_layout``)."""
    from encode_client.config_layout import towers_config

    return towers_config(config)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: the (thinker's) config itself (Qwen2.5-VL) or its ``text_config``."""
    thinker = thinker_config(config)
    return thinker.get("text_config", thinker)


def language_parameters(text: dict[str, Any]) -> int:
    """A Qwen2 language model: biased q, k, v; the embeddings once if tied, else with the LM head."""
    h, i, n = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    head = h // heads
    attention = h * h + h + 2 * (h * kv * head + kv * head) + h * h
    layer = attention + 3 * h * i + 2 * h
    embeddings = text["vocab_size"] * h * (1 if text["tie_word_embeddings"] else 2)
    return embeddings + n * layer + h


def vision_parameters(v: dict[str, Any]) -> int:
    """A Qwen2.5-VL vision tower: the patch embedding (unbiased), the blocks (two RMS norms, biased
    qkv and proj, a biased SwiGLU MLP) and the merger (an RMS norm and two biased linears)."""
    vh, vi, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v["spatial_merge_size"] ** 2
    block = (vh * 3 * vh + 3 * vh) + (vh * vh + vh) + 3 * vh * vi + 2 * vi + vh + 2 * vh
    patch = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2 * vh
    merger = vh + (merged * merged + merged) + (merged * v["out_hidden_size"] + v["out_hidden_size"])
    return patch + v["depth"] * block + merger


def audio_encoder_parameters(a: dict[str, Any]) -> int:
    """A Whisper-style audio encoder: two biased convs, the layers (q, v, out biased, k not; two
    layer norms; fc1, fc2) and the final layer norm; Qwen2-Audio's learned positions, or
    Qwen2.5-Omni's (its ``output_dim``) sinusoidal ones (a buffer), its parameter-free average pool,
    its biased projection to ``output_dim`` and its two audio bos/eos embeddings."""
    d, ffn, mels = a["d_model"], a["encoder_ffn_dim"], a["num_mel_bins"]
    layer = 4 * d * d + 3 * d + 2 * 2 * d + (d * ffn + ffn) + (ffn * d + d)
    convs = (mels * d * 3 + d) + (d * d * 3 + d)
    encoder = convs + a["encoder_layers"] * layer + 2 * d
    if "output_dim" not in a:
        return encoder + a["max_source_positions"] * d
    out = a["output_dim"]
    return encoder + (d * out + out) + 2 * out


def parameters(config: dict[str, Any]) -> dict[str, Any]:
    """Parameter counts of a case's config: ``language``, ``tower`` (all the towers: Qwen2.5-VL's
    vision tower and merger, Qwen2-Audio's audio encoder and projector, or Qwen2.5-Omni's vision
    tower and merger and audio encoder) and ``towers``, the same by the module vLLM builds each
    under (``visual``, ``audio_tower``, ``multi_modal_projector``)."""
    thinker, text = thinker_config(config), text_config(config)
    towers = {}
    if "vision_config" in thinker:
        towers["visual"] = vision_parameters(thinker["vision_config"])
    if "audio_config" in thinker:
        a = thinker["audio_config"]
        towers["audio_tower"] = audio_encoder_parameters(a)
        if "output_dim" not in a:  # Qwen2-Audio: a projector beside the encoder
            towers["multi_modal_projector"] = a["d_model"] * text["hidden_size"] + text["hidden_size"]
    return {"language": language_parameters(text), "tower": sum(towers.values()), "towers": towers}


@dataclass(frozen=True)
class Case:
    """One model measured: its real config, the tiny model whose tokenizer and processor it borrows
    (``module:function``, run in the vLLM venv), the token ids copied from it, the names of the
    tower's parameters, and the limits that make vLLM build no tower."""

    title: str
    config: dict[str, Any]
    tiny: str
    token_keys: tuple[str, ...]
    tower_prefixes: tuple[str, ...]
    tower_free_limits: dict[str, int]
    layers: int
    out: str
    budget_gib: float  # vLLM's memory budget: the weights built, and room for a KV cache beside them


CASES = {
    "qwen2_5_vl_3b": Case(
        "Qwen2.5-VL-3B-Instruct", QWEN2_5_VL_3B, "tests.vllm.tiny_qwen:make_tiny_qwen2_5_vl",
        ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "bos_token_id",
         "eos_token_id"),
        ("visual",), {"image": 0, "video": 0}, 8, "tower_memory.json", 6.0,
    ),
    "qwen2_audio_7b": Case(
        "Qwen2-Audio-7B-Instruct", QWEN2_AUDIO_7B, "tests.tiny.qwen2_audio:make_tiny_qwen2_audio",
        ("audio_token_index",), ("audio_tower", "multi_modal_projector"), {"audio": 0}, 2, "tower_memory_audio.json",
        9.0,  # its two layers' engine holds 6.3 GiB before any KV cache (156,032 x 4096 embeddings, untied)
    ),
    "qwen2_5_omni_7b": Case(
        "Qwen2.5-Omni-7B (thinker)", QWEN2_5_OMNI_7B, "tests.tiny.qwen2_5_omni:make_tiny_qwen2_5_omni",
        ("audio_token_index", "image_token_index", "video_token_index", "vision_start_token_id",
         "vision_end_token_id", "audio_start_token_id", "audio_end_token_id", "user_token_id", "eos_token_id",
         "pad_token_id"),
        ("visual", "audio_tower"), {"image": 0, "video": 0, "audio": 0}, 2, "tower_memory_omni.json",
        10.0,  # its two layers' engine holds 8.9 GiB before any KV cache with both towers, 5.8 without
    ),
}


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    text = text_config(config)
    head = text["hidden_size"] // text["num_attention_heads"]
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head * dtype_bytes


def make_config(case: Case, directory: Path, env_python: Path, layers: int) -> dict[str, Any]:
    """The tiny model's tokenizer and processor (built by vLLM's transformers), the real config."""
    module, function = case.tiny.split(":")
    code = f"import sys; from {module} import {function} as make; make(sys.argv[1])"
    subprocess.run([str(env_python), "-c", code, str(directory)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    tiny = json.loads((directory / "config.json").read_text())
    for weights in directory.glob("*.safetensors"):
        weights.unlink()  # a dummy load reads none
    config = json.loads(json.dumps(case.config))
    text_config(config)["num_hidden_layers"] = layers
    for key in case.token_keys:  # where the tiny config has it: the (thinker's) config or its text_config
        for mine, theirs in ((thinker_config(config), thinker_config(tiny)), (text_config(config), text_config(tiny))):
            if key in theirs:
                mine[key] = theirs[key]
                break
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return config


def _status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _built_weights(model: Any, tower_prefixes: tuple[str, ...]) -> dict[str, int]:
    """Bytes and parameters of what vLLM built, total and the tower's (``tower_prefixes``). vLLM's CPU
    backend packs each linear weight for oneDNN and leaves an empty parameter behind, so a packed
    weight is counted from its layer's input and output sizes; a tied weight (the LM head and the
    embeddings) once."""
    import torch

    out: dict[str, Any] = {"weight_bytes": 0, "tower_weight_bytes": 0, "parameters": 0, "tower_parameters": 0,
                           "towers": {}}
    seen: set[int] = set()
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            numel = p.numel()
            if numel == 0 and pname == "weight" and hasattr(module, "input_size_per_partition"):
                numel = module.input_size_per_partition * module.output_size_per_partition
            size = numel * torch.empty((), dtype=p.dtype).element_size()
            tower = name.startswith(tower_prefixes)
            out["weight_bytes"] += size
            out["parameters"] += numel
            out["tower_weight_bytes"] += size * tower
            out["tower_parameters"] += numel * tower
            if tower:
                prefix = name.split(".")[0]
                out["towers"][prefix] = out["towers"].get(prefix, 0) + numel
    return out


def child(case: Case, model: str, tower: bool, utilization: float) -> dict[str, Any]:
    """In the vLLM venv: start the engine, report weights, memory and the KV cache."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", enforce_eager=True, max_model_len=8192,
              gpu_memory_utilization=utilization, seed=0,
              **({} if tower else {"limit_mm_per_prompt": case.tower_free_limits}))
    seconds = time.perf_counter() - started
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    kv = core.scheduler.kv_cache_config
    kv_bytes = sum(t.size for t in kv.kv_cache_tensors)
    block = core.vllm_config.cache_config.block_size
    return {
        "tower": tower,
        **_built_weights(runner.get_model(), case.tower_prefixes),
        "kv_bytes": kv_bytes,
        "kv_tokens": kv.num_blocks * block,
        "startup_s": seconds,
        **{"rss_peak_bytes" if k == "VmHWM" else "rss_bytes": v for k, v in _status().items()},
    }


def _tree_rss(pid: int) -> int:
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(stat.parent.name) == pid or int(fields[1]) == pid:
                total += _status(stat.parent.name).get("VmRSS", 0)
        except (OSError, ValueError, IndexError):
            continue
    return total


def run_child(env_python: Path, case: str, model: Path, tower: bool, utilization: float, cap: int,
              log: Path) -> dict[str, Any]:
    """One measured engine in its own process, stopped if its memory passes ``cap``."""
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'clients' / 'python'}")
    out = log.with_suffix(".json")
    cmd = [str(env_python), "-m", "bench.tower_memory", "--case", case, "--child", str(model), "--child-out", str(out),
           "--utilization", str(utilization)] + (["--with-tower"] if tower else [])
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=sink, stderr=subprocess.STDOUT)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            if peak > cap:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"stopped: {peak / GIB:.1f} GiB resident, over the cap; see {log}")
            time.sleep(0.1)
    if proc.returncode != 0:
        raise RuntimeError(f"the engine failed ({proc.returncode}); see {log}")
    result = json.loads(out.read_text())
    result["rss_peak_polled_bytes"] = peak
    result["non_kv_bytes"] = result["rss_bytes"] - result["kv_bytes"]
    return result


def h200(config: dict[str, Any], utilization: float = 0.9) -> dict[str, Any]:
    """The whole model on an H200: the tower's weights in KV tokens, and their share."""
    counts = parameters(config)
    per_token = kv_bytes_per_token(config)
    budget = utilization * H200_BYTES
    weights = 2 * (counts["language"] + counts["tower"])
    kv_with = budget - weights  # an upper bound: less activations and non-torch memory
    return {
        "memory_bytes": H200_BYTES, "utilization": utilization, "budget_bytes": budget,
        "weight_bytes_with_tower": weights, "weight_bytes_tower_free": 2 * counts["language"],
        "kv_bytes_per_token": per_token, "tower_weight_bytes": 2 * counts["tower"],
        "kv_tokens_bought": 2 * counts["tower"] // per_token,
        "kv_tokens_with_tower_at_most": int(kv_with // per_token),
        "kv_gain_share": 2 * counts["tower"] / kv_with,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="qwen2_5_vl_3b")
    parser.add_argument("--layers", type=int,
                        help="decoder layers to build (default 8 of the 3B's 36; 2 of the audio 7B's 32, Omni's 28)")
    parser.add_argument("--budget-gib", type=float,
                        help="vLLM's memory budget for each engine (6; 9 for the audio 7B, 10 for the Omni)")
    parser.add_argument("--cap-gib", type=float, help="stop an engine whose memory passes this (budget + 1.5)")
    parser.add_argument("--out", type=Path,
                        help="default: bench/results/tower_memory.json (_audio, _omni for those cases)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--with-tower", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--utilization", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    case = CASES[args.case]
    args.budget_gib = args.budget_gib or case.budget_gib
    args.cap_gib = args.cap_gib or args.budget_gib + 1.5
    if args.child:
        args.child_out.write_text(json.dumps(child(case, args.child, args.with_tower, args.utilization)))
        return 0

    from bench.vllm_peer import vllm_env

    lines = Path("/proc/meminfo").read_text().splitlines()
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines}
    need = args.cap_gib * GIB + 2 * GIB
    if meminfo["MemAvailable"] < need:
        print(f"only {meminfo['MemAvailable'] / GIB:.1f} GiB free, {need / GIB:.1f} needed: not run", file=sys.stderr)
        return 2
    env_python = vllm_env() / "bin" / "python"
    layers = args.layers or case.layers
    work = Path(tempfile.mkdtemp(prefix="encode-bench-tower-"))
    model = work / f"{args.case}-sized"
    config = make_config(case, model, env_python, layers)
    utilization = args.budget_gib * GIB / meminfo["MemTotal"]
    runs = {}
    for tower in (False, True):  # one engine at a time
        name = "with_tower" if tower else "tower_free"
        runs[name] = run_child(env_python, args.case, model, tower, utilization, int(args.cap_gib * GIB),
                               work / f"{name}.log")
    counts = parameters(config)
    full = case.config
    whole_layers = text_config(full)["num_hidden_layers"]
    result = {
        "case": args.case,
        "config": f"{case.title}, {layers} of {whole_layers} decoder layers, bfloat16, --load-format dummy",
        "budget_gib": args.budget_gib, "runs": runs,
        "parameters_from_config": counts,
        "config_matches_vllm": runs["with_tower"]["parameters"] == counts["language"] + counts["tower"]
        and runs["with_tower"]["tower_parameters"] == counts["tower"]
        and runs["with_tower"]["towers"] == counts["towers"]
        and runs["tower_free"]["parameters"] == counts["language"]
        and runs["tower_free"]["tower_parameters"] == 0,
        "difference": {
            "weight_bytes": runs["with_tower"]["weight_bytes"] - runs["tower_free"]["weight_bytes"],
            "rss_bytes": runs["with_tower"]["rss_bytes"] - runs["tower_free"]["rss_bytes"],
            "rss_peak_bytes": runs["with_tower"]["rss_peak_bytes"] - runs["tower_free"]["rss_peak_bytes"],
            "non_kv_bytes": runs["with_tower"]["non_kv_bytes"] - runs["tower_free"]["non_kv_bytes"],
            "kv_tokens": runs["tower_free"]["kv_tokens"] - runs["with_tower"]["kv_tokens"],
            "kv_bytes_per_token": kv_bytes_per_token(config),
        },
        "whole_model": {"parameters": parameters(full), "kv_bytes_per_token": kv_bytes_per_token(full),
                        "h200": h200(full)},
        "machine": {"mem_total_bytes": meminfo["MemTotal"], "cpus": os.cpu_count()},
    }
    out = args.out or RESULTS / case.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"\nwrote {out}")
    return 0


def table(r: dict[str, Any]) -> str:
    t, w, d = r["runs"]["tower_free"], r["runs"]["with_tower"], r["difference"]
    rows = [
        ("weights (vLLM built)", "weight_bytes", GIB, "GiB"),
        ("of which the tower", "tower_weight_bytes", GIB, "GiB"),
        ("resident after start", "rss_bytes", GIB, "GiB"),
        ("resident peak", "rss_peak_bytes", GIB, "GiB"),
        ("resident, all but the KV cache", "non_kv_bytes", GIB, "GiB"),
        ("KV cache", "kv_bytes", GIB, "GiB"),
        ("KV tokens", "kv_tokens", 1, ""),
    ]
    lines = [r["config"], "| | with the tower | tower-free | difference |", "|---|---|---|---|"]
    for label, key, unit, suffix in rows:
        cells = [w[key] / unit, t[key] / unit, (w[key] - t[key]) / unit]
        text = [f"{x:.2f} {suffix}" if unit != 1 else f"{x:,.0f}" for x in cells]
        lines.append(f"| {label} | " + " | ".join(text) + " |")
    h = r["whole_model"]["h200"]
    lines.append(
        f"\nwhole model: {h['tower_weight_bytes'] / GIB:.2f} GiB of tower weights = "
        f"{h['kv_tokens_bought']:,} KV tokens at {h['kv_bytes_per_token']:,} B/token; H200 at 0.9: "
        f"{h['budget_bytes'] / GIB:.1f} GiB budget, at most {h['kv_tokens_with_tower_at_most']:,} KV tokens with the "
        f"tower, +{100 * h['kv_gain_share']:.2f}% without (the encoder profiling peak comes on top); measured here: "
        f"{d['kv_tokens']:,} more KV tokens at {d['kv_bytes_per_token']:,} B/token"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
