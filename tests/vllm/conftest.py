"""Shared pieces of the vLLM tests: a real vLLM engine (CPU build, in this process), a real
encode-server process (the project's .venv, ``ENCODE_SERVER_PYTHON``) serving the same tiny
Qwen2.5-VL checkpoint with ``--model DIR``, and a real Redis.

Run by ``make test-vllm`` in the cached vLLM venv. What several modules need alike is started once
a session: the Qwen2.5-VL encode-server (``epd_server``) and vLLM OpenAI servers, and each family's
encode-server, EPD stack and in-process engine (``family_server``, ``family_stack``,
``family_engine``: one family at a time); a module starts its own only where it needs other flags
(a Redis of its own for faults, an export directory, a cluster, tenants, a batch bound, a dtype).
"""

from __future__ import annotations

import atexit
import contextlib
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
    from tests.vllm.epd_stack import FamilyServer, FamilyStack

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
    """A vLLM ``LLM`` in this process, shut down (worker, EC connector) on exit. One at a time: the
    engines in a process share its distributed state and EC transfer (the last one's shutdown tears
    them down), so a family's shared engine (``family_engine``) is stopped first, and started again
    if a later test takes it."""
    from vllm import LLM

    SharedEngine.stop_running()
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


# -- the EPD stack over HTTP (test_proxy.py, test_security.py; epd_server for test_connector_with_tower.py too) --

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


# -- each family's encode-server, EPD stack over HTTP and in-process engine: one family at a time,
# -- shared by every module that proves the family

EPD_FAMILIES = {family.name: family for family in FAMILIES if family.epd is not None}
FAMILY_PREFIX = f"test-vllm-family-{os.getpid()}"
_OPEN: dict[tuple[str, str], ExitStack] = {}  # (fixture, family) -> what stops it


def on_family_stacks(*names: str) -> pytest.MarkDecorator:
    """The mark of a test (or a module, as ``pytestmark``) that runs on these families' shared
    fixtures only (``family``, indirectly parametrized: ``family_server``, ``family_stack``,
    ``family_engine``); without it a test that takes one runs on every family's."""
    return pytest.mark.parametrize("family", names, indirect=True)


@pytest.fixture(scope="session", params=sorted(EPD_FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    """The family (the param) whose shared fixtures a test takes. Session-scoped, so pytest runs the
    tests of every module that take the same family one after another (at the first one's place),
    and each of its shared processes starts once, not once a module. One family's run at a time:
    the previous family's stop when the next one's start, and each stops after the last test that
    takes it (``pytest_runtest_teardown``), not at the session's end."""
    from tests.vllm.families import PROXY_CASES

    name = str(request.param)
    if name not in PROXY_CASES:
        pytest.fail(f"{name} has an EPD contract but no record in tests/vllm/families.py's PROXY_CASES")
    return name


@contextmanager
def _held(fixture: str, name: str, manager: Any) -> Iterator[Any]:
    """``manager`` entered, stoppable by ``pytest_runtest_teardown`` once no later test takes
    ``fixture`` for the family ``name``."""
    with ExitStack() as running:
        _OPEN[(fixture, name)] = running
        try:
            yield running.enter_context(manager)
        finally:
            _OPEN.pop((fixture, name), None)


@pytest.fixture(scope="session")
def family_server(family: str, tmp_path_factory: pytest.TempPathFactory, logs: Path) -> Iterator[FamilyServer]:
    """The family's tiny checkpoint and encode-server (``epd_stack.family_server``: the shared Redis,
    the family's own prefix, ``--trust-request-mm-kwargs``), shared by its stack, its engine and
    every module that proves the family against it. Tests on one server keep apart by their items
    (each module its own seeds), not by a server each; a test that needs the store's entries
    replaced (zeros) puts the server's own back after."""
    from tests.vllm.epd_stack import family_server as open_server
    from tests.vllm.families import PROXY_CASES

    opened = open_server(PROXY_CASES[family], tmp_path_factory, logs, REDIS_URL, f"{FAMILY_PREFIX}-{family}")
    with _held("family_server", family, opened) as held:
        yield held


@pytest.fixture(scope="session")
def family_stack(
    family: str, family_server: FamilyServer, tmp_path_factory: pytest.TempPathFactory, logs: Path
) -> Iterator[FamilyStack]:
    """The family's EPD stack on its ``family_server`` (``epd_stack.family_stack``: vLLM's OpenAI
    server, an EC consumer that keeps its tower, a relay, two proxies), shared by every module that
    proves the family through vLLM's OpenAI server: its vLLM server starts once, not once a module."""
    from tests.vllm.epd_stack import family_stack as open_stack
    from tests.vllm.families import PROXY_CASES

    opened = open_stack(EPD_FAMILIES[family], PROXY_CASES[family], family_server.model, family_server.server,
                        tmp_path_factory, logs, REDIS_URL, family_server.prefix)
    with _held("family_stack", family, opened) as held:
        yield held


class SharedEngine:
    """An engine several modules take (``family_engine``), started on first use (``llm``) and stopped
    when another engine starts (``engine``: one at a time in a process) or after its last test; a
    later use starts it again. Tests that take it one after another share one start: a module that
    also starts engines of its own takes the shared one first (its tests in that order)."""

    _running: SharedEngine | None = None

    def __init__(self, name: str, start: Callable[[], Any]) -> None:
        self.name, self._start = name, start
        self._open: ExitStack | None = None
        self._llm: Any = None

    @property
    def llm(self) -> Any:
        if self._llm is None:
            SharedEngine.stop_running()
            opened = ExitStack()
            self._llm = opened.enter_context(self._start())
            self._open, SharedEngine._running = opened, self
            print(f"\n{self.name}: vLLM engine (EC consumer with its towers) started in "
                  f"{self._llm.startup_seconds:.1f} s")
        return self._llm

    def close(self) -> None:
        if SharedEngine._running is self:
            SharedEngine._running = None
        opened, self._open, self._llm = self._open, None, None
        if opened is not None:
            opened.close()

    @classmethod
    def stop_running(cls) -> None:
        if cls._running is not None:
            cls._running.close()


@pytest.fixture(scope="session")
def family_engine(family: str, family_server: FamilyServer) -> Iterator[SharedEngine]:
    """The family's vLLM engine in this process (``.llm``), an EC consumer of ``family_server`` that
    keeps its towers (``families.engine_args``): the engine of the modules that compare encode-server
    with vLLM's own towers and placeholders, and the pixels + uuid (or file + uuid) path. It is also
    plain vLLM, the oracle: an item under a uuid the store never holds (or none: vLLM's own hash) is
    encoded by its own tower. Tests on it reset its encoder cache where they read it."""
    from tests.vllm.families import engine_args as family_args

    config = connector_config(REDIS_URL, family_server.server.url, family_server.prefix, timeout_ms=1000)
    shared = SharedEngine(family, functools.partial(engine, family_server.model, config, **family_args(family)))
    with _held("family_engine", family, contextlib.closing(shared)) as held:
        yield held


def _family_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get("family")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After the test's own teardown (and its module's, where it was the module's last), stop each
    of its family's shared fixtures that no later test takes (a session-scoped fixture would hold
    its processes, 1-2 GB a family, to the session's end): the last opened first."""
    try:
        yield
    finally:
        name = _family_of(item)
        if name is not None:
            items = item.session.items
            later = [i for i in items[items.index(item) + 1:] if _family_of(i) == name]
            for fixture, family in reversed(list(_OPEN)):
                if family == name and not any(fixture in i.fixturenames for i in later):
                    _OPEN.pop((fixture, family)).close()
