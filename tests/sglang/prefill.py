"""SGLang 0.5.23's language-only prefill, its receiving side only, driven in this process.

What runs is SGLang's own code, as its tokenizer manager and scheduler call it: ``MMReceiverHTTP``
(``encode``: the split of a request's items over the encoders and the ``POST /encode`` of each
part; ``recv_mm_data``: the ``zmq_to_tokenizer`` receive; ``send_encode_request`` and
``process_waiting_requests``: ``zmq_to_scheduler``, with ``POST /scheduler_receive_url`` from each
tensor-parallel rank and each rank's shared PULL socket), the allow-list unpickler
(``safe_pickle_loads``), the part collection (``MultiModalEmbeddingData``), and the family's
multimodal processor built from the checkpoint (``_init_mm_processor``), whose
``get_validated_mm_data`` lays the rows into the prompt's placeholders and checks their counts.

What is not SGLang's here: no model runs (a whole prefill needs CUDA), and a rank's tensor-parallel
group is one process's gloo group of one: every rank's ``all_reduce`` of the waiting requests' status
is its own, so each rank must reach SUCCESS by itself (SGLang's reduction, the MIN over ranks, only
ends a request sooner when another rank failed). The ranks' sockets, registrations and ``receive_count``
(the TP size) are SGLang's own.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import tempfile
import threading
import time
import uuid
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# Before SGLang is imported: loopback only (its receivers bind and advertise SGLANG_HOST_IP), offline,
# and a receive timeout short enough for a test to fail rather than hang.
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("SGLANG_ENCODER_RECV_TIMEOUT", "60")
os.environ.setdefault("SGLANG_ENCODER_HTTP_TIMEOUT", "60")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from sglang.srt.disaggregation.encoder.receiver import (
    MMReceiverGrpc,
    MMReceiverHTTP,
    WaitingMMRequestStatus,
)
from sglang.srt.managers.io_struct import (
    EncoderDispatchErrorReq,
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.managers.tokenizer_manager import _reject_missing_dispatched_encoder_embedding
from sglang.srt.runtime_context import get_parallel, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from transformers import AutoConfig

__all__ = ["Failure", "Prefill", "Received", "modality_rows"]

BACKENDS = ("zmq_to_tokenizer", "zmq_to_scheduler")
# SGLang's receivers by transport (its create_mm_receiver's table, SGLANG_ENCODER_MM_RECEIVER_MODE):
# HTTP encoders, or gRPC ones (``grpc://host:port``, its --grpc-mode).
RECEIVERS: dict[str, type[MMReceiverHTTP] | type[MMReceiverGrpc]] = {"http": MMReceiverHTTP, "grpc": MMReceiverGrpc}


class Failure(Exception):
    """SGLang's prefill gave the request up: what it would abort the user's request with."""

    def __init__(self, message: str | None, code: int | None) -> None:
        super().__init__(f"{code}: {message}")
        self.message = message
        self.code = code


@dataclass
class Received:
    """What SGLang's receiver made of a request: its ``MultimodalProcessorOutput`` (per rank under
    ``zmq_to_scheduler``, ranks in order)."""

    outputs: list[Any]
    seconds: float

    @property
    def output(self) -> Any:
        return self.outputs[0]


def modality_rows(output: Any) -> dict[str, torch.Tensor]:
    """The rows SGLang laid into the prompt, per modality (``image``, ``video``), in placeholder order."""
    rows: dict[str, list[torch.Tensor]] = {}
    for item in output.mm_items:
        rows.setdefault(item.modality.name.lower(), []).append(item.precomputed_embeddings)
    return {name: torch.cat(parts) for name, parts in rows.items()}


class _OneProcessTpGroup:
    """A TP group as SGLang's receiver uses it (``cpu_group`` for the status ``all_reduce``,
    ``all_gather_object`` for start-up errors), over this process's gloo group of one."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.cpu_group = dist.group.WORLD

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size


_dist_lock = threading.Lock()


def _init_gloo() -> None:
    with _dist_lock:
        if not dist.is_initialized():
            handle, store = tempfile.mkstemp(prefix="sglang-gloo-")
            os.close(handle)
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


@dataclass
class _Scheduler:
    """What a scheduler-side receiver reads of its scheduler: none of ``model_config`` when it builds
    (it then picks the family's processor by the architecture alone, as without a model runner), and,
    when it aborts a request (``create_req``), what SGLang's own unit test gives it."""

    model_config: Any = None
    disaggregation_mode: Any = None
    metrics_reporter: Any = field(default_factory=lambda: SimpleNamespace(enable_metrics=False))
    metrics_collector: Any = None
    dllm_config: Any = None
    tokenizer: Any = None

    def abort_ready(self, hf_config: Any, tokenizer: Any) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        text = getattr(hf_config, "text_config", hf_config)
        self.model_config = SimpleNamespace(hf_eos_token_id={int(getattr(text, "eos_token_id", None) or 0)},
                                            vocab_size=int(getattr(text, "vocab_size", 0) or 0))
        self.disaggregation_mode = DisaggregationMode.NULL
        self.tokenizer = tokenizer


class Prefill:
    """One SGLang prefill (``--language-only --encoder-urls ...``) on ``model_dir``, ``backend``
    ``zmq_to_tokenizer`` or ``zmq_to_scheduler`` with ``tp_size`` ranks, its encoders called over
    ``transport`` (``http``, or ``grpc``: ``encoder_urls`` are then ``grpc://host:port``).

    Its configuration is process-wide in SGLang (``publish``): build one prefill at a time, and use
    it before building the next."""

    def __init__(self, model_dir: str, encoder_urls: Sequence[str], *, backend: str = "zmq_to_tokenizer",
                 tp_size: int = 1, timeout: float = 60.0, transport: str = "http") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        receiver = RECEIVERS[transport]
        self.backend = backend
        self.timeout = timeout
        self.args = ServerArgs(
            model_path=model_dir, device="cpu", host="127.0.0.1", language_only=True,
            encoder_urls=list(encoder_urls), encoder_transfer_backend=backend, tp_size=tp_size,
        )
        publish(self.args, role="tokenizer")
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        # The tokenizer manager's receiver (the dispatch, and the zmq_to_tokenizer receive) and its
        # processor: what the scheduler-side receiver builds too (``_init_mm_processor``).
        # A list is shared, not copied: the tokenizer manager hands its receiver the encoder bootstrap's
        # own list, which grows and shrinks as encoders register, unregister and fail their probes.
        urls = encoder_urls if isinstance(encoder_urls, list) else list(encoder_urls)
        self.tokenizer_side = receiver(self.args, hf_config=self.hf_config, encode_urls=urls)
        self.tokenizer_side._init_mm_processor(self.args, self.hf_config)
        self.mm_processor = self.tokenizer_side.mm_processor
        self.tokenizer = self.mm_processor._processor.tokenizer
        self.ranks: list[MMReceiverHTTP | MMReceiverGrpc] = []
        if backend == "zmq_to_scheduler":
            _init_gloo()
            group = _OneProcessTpGroup(tp_size)
            for rank in range(tp_size):
                with get_parallel().override(tp_rank=rank, attn_tp_rank=rank, attn_dp_rank=0, attn_cp_rank=0,
                                             pp_rank=0, tp_group=group, pp_group=None):
                    scheduler = _Scheduler()
                    self.ranks.append(receiver(self.args, hf_config=self.hf_config, scheduler=scheduler))
                    scheduler.abort_ready(self.hf_config, self.tokenizer)

    @property
    def encoder_urls(self) -> list[str]:
        return self.tokenizer_side.encode_urls

    def request(self, prompt: str, *, images: Sequence[Any] = (), videos: Sequence[Any] = (),
                audios: Sequence[Any] = (), rid: str | None = None) -> GenerateReqInput:
        """A generate request as SGLang's HTTP server hands it to the tokenizer manager."""
        obj = GenerateReqInput(text=prompt, image_data=list(images) or None, video_data=list(videos) or None,
                               audio_data=list(audios) or None, rid=rid or uuid.uuid4().hex)
        obj.need_wait_for_mm_inputs = True
        return obj

    def receive(self, prompt: str, *, images: Sequence[Any] = (), videos: Sequence[Any] = (),
                audios: Sequence[Any] = (), ranks_after: float = 0.0) -> Received:
        """The request's embeddings through this prefill's backend, or ``Failure``. ``ranks_after``:
        seconds between the tokenizer's dispatch and the ranks' first tick (their registrations then
        reach the encoders after its ``/encode``)."""
        started = time.monotonic()
        obj = self.request(prompt, images=images, videos=videos, audios=audios)
        if self.backend == "zmq_to_tokenizer":
            outputs = [self._receive_at_tokenizer(obj, prompt)]
        else:
            outputs = self._receive_at_ranks(obj, prompt, ranks_after)
        return Received(outputs, time.monotonic() - started)

    def _receive_at_tokenizer(self, obj: GenerateReqInput, prompt: str) -> Any:
        """As the tokenizer manager's ``_tokenize_one_request`` does in language-only mode."""
        output = asyncio.run(self.tokenizer_side.recv_mm_data(
            request_obj=obj, mm_processor=self.mm_processor, prompt=prompt,
            need_wait_for_mm_inputs=obj.need_wait_for_mm_inputs))
        try:
            _reject_missing_dispatched_encoder_embedding(obj, output)
        except Exception as error:  # fastapi's HTTPException: what the user gets
            raise Failure(getattr(error, "detail", str(error)), getattr(error, "status_code", None)) from None
        return output

    def _tokenized(self, obj: GenerateReqInput, prompt: str) -> TokenizedGenerateReqInput:
        """The request as the tokenizer sends it to every rank (each rank gets its own copy)."""
        return TokenizedGenerateReqInput(
            rid=obj.rid, input_text=prompt, input_ids=array("q", self.tokenizer.encode(prompt)), input_embeds=None,
            mm_inputs=None, token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=1),
            return_logprob=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False,
            need_wait_for_mm_inputs=True, num_items_assigned=obj.num_items_assigned,
            encoder_urls=obj.encoder_urls,
        )

    def _receive_at_ranks(self, obj: GenerateReqInput, prompt: str, ranks_after: float) -> list[Any]:
        """The tokenizer dispatches (``send_encode_request``: ``/encode`` without a port, in a thread),
        every rank registers its socket and polls (``process_waiting_requests``, the scheduler's tick)."""
        dispatch_errors: list[EncoderDispatchErrorReq] = []
        ready = self.tokenizer_side.send_encode_request(obj, on_dispatch_error=dispatch_errors.append)
        if ready is None:
            raise AssertionError("SGLang did not dispatch the request to an encoder")
        per_rank = [self._tokenized(obj, prompt) for _ in self.ranks]
        time.sleep(ranks_after)
        ready.set()  # the scheduler has the request: a dispatch error may now be delivered to it
        inbox: list[list[Any]] = [[req] for req in per_rank]
        delivered = 0
        ended: list[Any] = [None] * len(self.ranks)  # a rank's output, or its Failure
        deadline = time.monotonic() + self.timeout
        while any(end is None for end in ended):
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer from every rank in {self.timeout} s: {ended}")
            for error in dispatch_errors[delivered:]:  # the scheduler broadcasts it to every rank
                for box in inbox:
                    box.append(error)
            delivered = len(dispatch_errors)
            for index, (rank, box) in enumerate(zip(self.ranks, inbox, strict=True)):
                if ended[index] is not None:
                    continue
                ticked, box[:] = list(box), []
                done, aborted = rank.process_waiting_requests(ticked)
                for _req, message, code in aborted:
                    ended[index] = Failure(message, int(code) if code is not None else None)
                for req in done:
                    if req.rid == obj.rid:
                        ended[index] = req.mm_inputs
            time.sleep(0.005)
        for end in ended:  # SGLang's status all-reduce fails the request on every rank when one failed
            if isinstance(end, Failure):
                raise end
        return ended

    def pending(self) -> int:
        """Requests still waiting on any rank (none once every test request ended)."""
        return sum(1 for rank in self.ranks for req in rank.waiting_list
                   if req.status == WaitingMMRequestStatus.PENDING)

    def close(self) -> None:
        for receiver in itertools.chain([self.tokenizer_side], self.ranks):
            if receiver.scheduler_recv_socket is not None:
                receiver.scheduler_recv_socket.close(linger=0)
            if receiver.registration_runner is not None:
                loop = receiver.registration_runner.loop
                loop.call_soon_threadsafe(loop.stop)


def image_modality() -> Modality:
    return Modality.IMAGE
