"""Shared pieces of the vLLM tests: a real vLLM engine (CPU build, in this process), a real
encode-server process (the project's .venv, ``ENCODE_SERVER_PYTHON``) serving the same tiny
Qwen2.5-VL checkpoint with ``--model DIR``, and a real Redis.

Run by ``make test-vllm`` in the cached vLLM venv; one engine per test module.
"""

from __future__ import annotations

import atexit
import functools
import gc
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

if TYPE_CHECKING:
    from tests.vllm.epd_stack import FamilyStack

# Before vLLM is imported: the engine in this process, on the CPU, with a small KV cache.
os.environ.update(
    VLLM_ENABLE_V1_MULTIPROCESSING="0",
    VLLM_TARGET_DEVICE="cpu",
    VLLM_CPU_KVCACHE_SPACE="1",
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
)

from encode_server.encoders import FAMILIES
from tests import startups
from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl

# vLLM's Kimi-K2.5 image processor is compiled by numba with cache=True: into this run's own
# directory (the servers this process starts inherit it), not the shared venv's site-packages.
if "NUMBA_CACHE_DIR" not in os.environ:
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="encode-server-numba-")
    atexit.register(shutil.rmtree, os.environ["NUMBA_CACHE_DIR"], ignore_errors=True)

PROMPT_HEAD = "<|im_start|>user\n"
PROMPT_TAIL = "describe the image<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 8
CONNECTOR_MODULE = "encode_client.vllm_connector"


def prompt(n_images: int = 1) -> str:
    return PROMPT_HEAD + IMAGE * n_images + PROMPT_TAIL


def png(width: int, height: int, seed: int) -> bytes:
    """A deterministic noisy PNG: distinct images give distinct embeddings."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    pixels = (rng.rand(height, width, 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def pil(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data)).convert("RGB")


_CHECKPOINTS: dict[str, Path] = {}


def tiny_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, build: Callable[..., Path], *args: Any, **kwargs: Any
) -> Path:
    """``build(directory, *args, **kwargs)``, once per session: the modules that serve the same
    checkpoint share its directory, which every engine and server only reads (a test that needs
    other settings copies it: ``copy_with_processor_settings``). The builder and its arguments are
    the key (a ``functools.partial`` is unwrapped into them), so one build is one checkpoint: pass
    the same arguments the same way (``kind=`` by keyword) to share it."""
    while isinstance(build, functools.partial):
        args, kwargs, build = (*build.args, *args), {**build.keywords, **kwargs}, build.func
    key = repr((build.__module__, build.__qualname__, args, sorted(kwargs.items())))
    if key not in _CHECKPOINTS:
        _CHECKPOINTS[key] = build(tmp_path_factory.mktemp(f"tiny-{build.__name__}"), *args, **kwargs)
    return _CHECKPOINTS[key]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory, make_tiny_qwen2_5_vl)


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


# The tower-free consumer (the documented EPD setup): every modality's limit 0, so vLLM builds no
# vision tower and skips its encoder profiling, and accepts only embeddings items (metadata + uuid,
# or the tensor itself). The engine with the tower is for the tests that need vLLM to see pixels
# (and for the families whose EPD mode is pixels + uuid: their prefill keeps its tower).
TOWER_FREE_LIMITS = {"image": 0, "video": 0}
TOWER_LIMITS = {"image": 4, "video": 0}


def engine_args(
    model: Path, ec_transfer_config: dict[str, Any] | None, *, tower: bool = False, dtype: str = "float32",
    **overrides: Any,
) -> dict[str, Any]:
    """The engine the tests start: float32 (unless ``dtype``), eager, no prefix or processor cache
    (a repeated request must reach the connector again, not vLLM's own caches); tower-free unless
    ``tower``. ``overrides`` replace any of these or add others (video limits, a family's
    ``mm_processor_kwargs``)."""
    args: dict[str, Any] = {
        "model": str(model),
        "dtype": dtype,
        "enforce_eager": True,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "limit_mm_per_prompt": TOWER_LIMITS if tower else TOWER_FREE_LIMITS,
        "enable_prefix_caching": False,
        "mm_processor_cache_gb": 0,
        "seed": 0,
    }
    if ec_transfer_config is not None:
        args["ec_transfer_config"] = ec_transfer_config
    return {**args, **overrides}


@contextmanager
def engine(
    model: Path, ec_transfer_config: dict[str, Any] | None = None, *, tower: bool = False, dtype: str = "float32",
    **overrides: Any,
) -> Iterator[Any]:
    """A vLLM ``LLM`` in this process, shut down (worker, EC connector) on exit."""
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(**engine_args(model, ec_transfer_config, tower=tower, dtype=dtype, **overrides))
    llm.startup_seconds = time.perf_counter() - started  # type: ignore[attr-defined]
    role = "EC consumer" if ec_transfer_config else "plain"
    startups.record("vLLM engine (in-process)", f"{model.name}, {role}, tower {tower}", llm.startup_seconds)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def model_runner(llm: Any) -> Any:
    """The worker's model runner of an in-process engine (its encoder cache, its model)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def tower_parameters(llm: Any) -> int:
    """How many parameters of vLLM's vision tower the engine holds (0: tower-free)."""
    model = model_runner(llm).get_model()
    return sum(p.numel() for name, p in model.named_parameters() if name.startswith("visual."))


def connector_config(redis_url: str, encoder_url: str, prefix: str, **extra: Any) -> dict[str, Any]:
    return {
        "ec_connector": "EncodeServerECConnector",
        "ec_connector_module_path": CONNECTOR_MODULE,
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"redis_url": redis_url, "encoder_url": encoder_url, "prefix": prefix, **extra},
    }


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process engine (its ``counts``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.ec_connector


def greedy(llm: Any, requests: Sequence[dict[str, Any]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy token ids for each request (``{"prompt", "multi_modal_data", ...}``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(list(requests), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def outcome(llm: Any, request: dict[str, Any]) -> tuple[str | None, list[int]]:
    """(finish_reason, tokens) of one request: "error" when the engine failed it."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([request], params, use_tqdm=False)[0].outputs[0]
    return out.finish_reason, list(out.token_ids)


def metadata_only(grid: Sequence[int], mm_hash: str, n: int = 1) -> dict[str, Any]:
    """The EPD request: no pixels, the grid that sizes the placeholder, and uuid = mm_hash."""
    import torch

    item = {"image_grid_thw": torch.tensor([list(grid)])}
    return {"prompt": prompt(n), "multi_modal_data": {"image": item}, "multi_modal_uuids": {"image": [mm_hash]}}


def direct_embeds(embedding: Any, grid: Sequence[int]) -> dict[str, Any]:
    """The oracle: the same embedding given to vLLM directly as ``image_embeds``."""
    import torch

    item = {"image_embeds": torch.tensor(np.array(embedding)), "image_grid_thw": torch.tensor([list(grid)])}
    return {"prompt": prompt(), "multi_modal_data": {"image": item}}


def pixels(data: bytes, uuid: str | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {"prompt": prompt(), "multi_modal_data": {"image": pil(data)}}
    if uuid is not None:
        request["multi_modal_uuids"] = {"image": [uuid]}
    return request


def stored_value(embedding: Any, fingerprint: str, mm_hash: str, meta: dict[str, Any]) -> bytes:
    """A value in the server's store format (the client's ``dump_value``), for replacing one in a test."""
    from encode_client.safetensors import from_numpy
    from encode_client.store import dump_value

    return dump_value(fingerprint, mm_hash, from_numpy("embedding", np.asarray(embedding, dtype="<f4")), meta)


def epd_baseline(llm: Any, client: Any, images: Sequence[bytes]) -> dict[str, Any]:
    """Hand ``images`` off to encode-server (``client``), then the greedy tokens of the EPD request
    (metadata only, uuid = mm_hash) and of the same embeddings given to vLLM directly."""
    results = client.hand_off(list(images))
    grids = [r.meta["image_grid_thw"] for r in results]
    hashes = [r.hash for r in results]
    embeddings = [r.numpy() for r in client.encode(list(images))]
    started = time.perf_counter()
    via_connector = greedy(llm, [metadata_only(g, h) for g, h in zip(grids, hashes, strict=True)])
    seconds = time.perf_counter() - started
    direct = greedy(llm, [direct_embeds(e, g) for e, g in zip(embeddings, grids, strict=True)])
    print(f"\n{len(images)} EPD requests (metadata only) in one batch: {seconds * 1000:.0f} ms")
    return {"grids": grids, "hashes": hashes, "embeddings": embeddings, "connector": via_connector, "direct": direct}


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample's values whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


# -- the EPD stack over HTTP (test_proxy.py, test_security.py): one vLLM OpenAI server for both --

REDIS_URL = os.environ.get("ENCODE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
EPD_PREFIX = f"test-vllm-epd-{os.getpid()}"


@pytest.fixture(scope="session")
def epd_server(model_dir: Path, logs: Path) -> Iterator[Any]:
    """encode-server on the shared Redis, under the session's own prefix (deleted at the end)."""
    import redis

    from tests.redis_procs import delete_prefix
    from tests.server import start_server

    proc = start_server(
        "--model", str(model_dir), "--redis-url", REDIS_URL, "--cache-prefix", EPD_PREFIX, "--grpc-port", "0",
        "--dtype", "float32", log_dir=logs,
    )
    yield proc
    proc.stop()
    delete_prefix(redis.Redis.from_url(REDIS_URL), EPD_PREFIX)


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path, epd_server: Any, logs: Path) -> Iterator[dict[str, Any]]:
    """vLLM's OpenAI server, a tower-free EC consumer of ``epd_server``'s Redis prefix (every
    tenant's keys): what docs/vllm.md tells an operator to run."""
    from tests.vllm.epd_stack import vllm_openai_server

    extra = {"redis_url": REDIS_URL, "encoder_url": epd_server.url, "prefix": EPD_PREFIX}
    with vllm_openai_server(model_dir, extra, logs) as server:
        yield server


@pytest.fixture(scope="session")
def plain_vllm(model_dir: Path, logs: Path) -> Iterator[dict[str, Any]]:
    """Plain vLLM's OpenAI server with its own tower and no connector: the oracle that answers on
    the pixels, shared by every test that needs one."""
    from tests.vllm.epd_stack import vllm_openai_server

    with vllm_openai_server(model_dir, None, logs, tower=True) as server:
        yield server


@pytest.fixture(scope="session")
def relay(vllm_server: dict[str, Any]) -> Iterator[Any]:
    """The recording relay every proxy of the tests sends to vLLM through."""
    from tests.vllm.epd_stack import Relay

    with Relay(vllm_server["port"]) as r:
        yield r


@contextmanager
def running_proxy(upstream: str, encoders: Sequence[str], **options: Any) -> Iterator[Any]:
    """An ``EPDProxy`` in a thread of this process, shut down on exit."""
    import threading

    from encode_client.proxy import EPDProxy

    proxy = EPDProxy(("127.0.0.1", 0), upstream, list(encoders), timeout=120, **options)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.shutdown()
        proxy.server_close()


# -- each family's EPD stack over HTTP: one at a time, shared by every module that proves the family --

EPD_FAMILIES = {family.name: family for family in FAMILIES if family.epd is not None}
FAMILY_PREFIX = f"test-vllm-family-{os.getpid()}"
_OPEN_STACKS: dict[str, ExitStack] = {}


def on_family_stacks(*names: str) -> pytest.MarkDecorator:
    """The mark of a test (or a module, as ``pytestmark``) that runs on these families' stacks only
    (``family_stack``, indirectly parametrized); without it a test runs on every family's."""
    return pytest.mark.parametrize("family_stack", names, indirect=True)


@pytest.fixture(scope="session", params=sorted(EPD_FAMILIES))
def family_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, logs: Path
) -> Iterator[FamilyStack]:
    """The family's (the param's) EPD stack (``epd_stack.family_stack``), shared by every module that
    proves the family through vLLM's OpenAI server: session-scoped, so pytest runs the tests of
    every module that take the same family's stack one after another (at the first one's place),
    and its vLLM server starts once, not once a module. One runs at a time: the previous family's
    stops when the next one's starts, and each stops after the last test that takes it
    (``pytest_runtest_teardown``), not at the session's end."""
    from tests.vllm.epd_stack import family_stack as open_stack
    from tests.vllm.families import PROXY_CASES

    name = request.param
    if name not in PROXY_CASES:
        pytest.fail(f"{name} has an EPD contract but no record in tests/vllm/families.py's PROXY_CASES")
    with ExitStack() as running:
        _OPEN_STACKS[name] = running
        try:
            yield running.enter_context(open_stack(EPD_FAMILIES[name], PROXY_CASES[name], tmp_path_factory, logs,
                                                   REDIS_URL, f"{FAMILY_PREFIX}-{name}"))
        finally:
            _OPEN_STACKS.pop(name, None)


def _stack_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("family_stack")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After the test's own teardown, stop its family's stack if no later test takes it (a
    session-scoped fixture would hold its two servers, 1-2 GB, to the session's end)."""
    try:
        yield
    finally:
        name = _stack_of(item)
        if name in _OPEN_STACKS:
            items = item.session.items
            if all(_stack_of(later) != name for later in items[items.index(item) + 1:]):
                _OPEN_STACKS.pop(name).close()
