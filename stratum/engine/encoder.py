"""The encoder core: an engine for an encoder model (`models.bert`), behind the same loop and client as the
decoder's (`loop.LoopEngine`). Every request is prefill only: each step takes the waiting requests, best
priority first, that fit the token budget together, runs them as one batch and answers each with its
pooled vector (or its score). An encoder attends both ways, so a sequence is never split across steps:
one longer than the budget runs alone.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from stratum.engine.config import EngineConfig, ResolvedConfig, configured_threads, default_threads
from stratum.engine.outputs import MetaState, RequestOutput, RequestStats, StepError, StepStats
from stratum.engine.protocol import EngineInfo, EngineSnapshot, KVBlocks
from stratum.engine.sampling_params import InvalidRequestError, SamplingParams
from stratum.kernels import KernelPlan, PlanSource
from stratum.kernels.numerics import PYTORCH, Numerics
from stratum.models.bert import BertEncoder, EncoderCheckpoint
from stratum.models.loader import file_identity

log = logging.getLogger("stratum.engine")

ENCODER_STEP = "encoder"  # the snapshot's `step`: an encoder's forward, no KV pool


def make_engine(config: EngineConfig, checkpoint=None):
    """The engine for `config`'s model: an `EncoderCore` for an encoder, else an `EngineCore`."""
    from stratum.engine import builder

    checkpoint = checkpoint or builder.load(config)
    if isinstance(checkpoint, EncoderCheckpoint):
        return EncoderCore(config, checkpoint)
    from stratum.engine.core import EngineCore

    return EngineCore(config, checkpoint)


@dataclass(slots=True)
class EncodeRequest:
    """One input waiting to be encoded: its tokens, what it asks for and when it came."""

    request_id: str
    token_ids: list[int]
    task: str  # "embed" | "score"
    priority: int
    arrival_time: float
    first_scheduled_time: float | None = None
    order: int = 0  # arrival order: ties of priority run first come, first served

    def __lt__(self, other: "EncodeRequest") -> bool:
        return (self.priority, self.order) < (other.priority, other.order)


@dataclass
class _Counts:
    steps: deque = field(default_factory=lambda: deque(maxlen=64))  # recent StepStats
    num_steps: int = 0


class EncoderCore:
    """Owns an encoder and the requests waiting for it; `loop.EngineLoop` drives it as it drives `EngineCore`.

    Args:
        config: engine settings (device, threads, the scheduler's token budget and batch size).
        checkpoint: a loaded encoder checkpoint (its weights are taken).
    """

    mode = "normal"  # an encoder has no cache or preemption logic to fall back from

    def __init__(self, config: EngineConfig, checkpoint: EncoderCheckpoint):
        device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        threads = config.num_threads or default_threads(config.serving)
        torch.set_num_threads(threads)
        self.model_config = cfg = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.path = checkpoint.path
        self.model = BertEncoder(checkpoint)
        self.device = torch.device(device)
        if device != "cpu":
            self.model.to(self.device)
        source = PlanSource.CONFIGURED if configured_threads(config.num_threads) else PlanSource.RULE
        numerics = Numerics(file_identity(checkpoint.path), device, PYTORCH, "float32", "float32", (("F32", "dense"),),
                            "pytorch", None, platform=f"torch {torch.__version__}")
        self.config = ResolvedConfig(
            model=config.model, device=device, dtype="float32", block_size=config.block_size, num_kv_blocks=0,
            max_model_len=cfg.max_model_len, enable_prefix_cache=False, num_threads=threads, prefill_threads=threads,
            kernel_plan=KernelPlan(device, threads, source=source, basis="an encoder on PyTorch's step"),
            seed=config.seed, scheduler=config.scheduler, default_temperature=0.0, default_top_p=1.0,
            numerics=numerics)
        self.tasks = (cfg.pooling.task,)
        self.waiting: list[EncodeRequest] = []  # a heap, best priority then earliest first
        self.requests: dict[str, EncodeRequest] = {}
        self._order = itertools.count()
        self._started: list[str] = []
        self.counts = _Counts()

    @property
    def chat_template(self):
        from stratum.models.chat_template import ChatTemplate

        return ChatTemplate(None, self.tokenizer)

    def info(self) -> EngineInfo:
        cfg = self.model_config
        path = self.path
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        facts = {"architecture": cfg.architecture, "name": cfg.name,
                 "format": "gguf" if path.suffix == ".gguf" else "safetensors",
                 "num_parameters": sum(t.numel() for t in self.model.tensors()), "quantization": "F32",
                 "file_bytes": sum(f.stat().st_size for f in files), "context_length": cfg.max_model_len,
                 "embedding_length": cfg.hidden_size, "block_count": cfg.num_layers,
                 "feed_forward_length": cfg.intermediate_size, "head_count": cfg.num_heads,
                 "vocab_size": cfg.vocab_size, "pooling_type": cfg.pooling.kind}
        return EngineInfo(self.config, cfg.name, cfg.vocab_size, {"step": ENCODER_STEP, "device": self.config.device},
                          facts, tasks=self.tasks, pooling=cfg.pooling.kind, embedding_size=self.model.embedding_size)

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                    priority: int = 0, task: str = "generate", **_options) -> EncodeRequest:
        """Queue one input; `sampling` and the decoder's options (cache, tools, reasoning) do not apply.

        Raises:
            InvalidRequestError: a task the model does not serve, an empty or too long input, ids out of range.
        """
        if task not in self.tasks:
            raise InvalidRequestError(f"this model serves {', '.join(self.tasks)}, not {task}")
        n, limit, vocab = len(prompt_token_ids), self.config.max_model_len, self.model_config.vocab_size
        if n == 0:
            raise InvalidRequestError("the input is empty")
        if n > limit:
            raise InvalidRequestError(f"the input ({n} tokens) exceeds the context length of {limit} tokens")
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        req = EncodeRequest(request_id, list(prompt_token_ids), task, priority, time.perf_counter(),
                            order=next(self._order))
        heapq.heappush(self.waiting, req)
        self.requests[request_id] = req
        return req

    def expected_cached_tokens(self, _req) -> int:
        return 0  # no prefix cache: every token is computed

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
            heapq.heapify(self.waiting)
        return self._output(req, None, "abort", time.perf_counter())

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def take_started(self) -> list[str]:
        started, self._started = self._started, []
        return started

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def recent_cache_keys(self, max_keys: int) -> list[bytes]:
        return []

    # ---- the step ----------------------------------------------------------------------------------
    def _schedule(self) -> list[EncodeRequest]:
        """The waiting requests, best first, while they fit the token budget and batch size (at least one)."""
        budget, max_seqs = self.config.scheduler.max_num_batched_tokens, self.config.scheduler.max_num_seqs
        batch, tokens = [], 0
        while self.waiting and len(batch) < max_seqs:
            n = len(self.waiting[0].token_ids)
            if batch and tokens + n > budget:
                break
            batch.append(heapq.heappop(self.waiting))
            tokens += n
        return batch

    def step(self) -> list[RequestOutput]:
        """One batch: schedule -> encode -> pool -> one finished output per request.

        Raises:
            StepError: the forward failed; it names the requests that were in it.
        """
        t0 = time.perf_counter()
        batch = self._schedule()
        if not batch:
            return []
        for req in batch:
            req.first_scheduled_time = t0
        self._started += [req.request_id for req in batch]
        try:
            vectors = self._encode(batch)
        except Exception as e:
            raise StepError([r.request_id for r in batch], e) from e
        t1 = time.perf_counter()
        tokens = sum(len(r.token_ids) for r in batch)
        self.counts.steps.append(StepStats(len(batch), 0, tokens, t1 - t0, t1 - t0))
        self.counts.num_steps += 1
        outputs = []
        for req, vector in zip(batch, vectors):
            self.requests.pop(req.request_id, None)
            outputs.append(self._output(req, vector, "stop", t1))
        return outputs

    def _encode(self, batch: list[EncodeRequest]) -> list[list[float]]:
        ids, types, positions, lengths = [], [], [], []
        sep = self.model_config.sep_token_id
        for req in batch:
            n = len(req.token_ids)
            ids += req.token_ids
            positions += range(n)
            lengths.append(n)
            first = n
            if req.task == "score" and sep in req.token_ids:  # [CLS] query [SEP] is type 0, the document type 1
                first = req.token_ids.index(sep) + 1
            types += [0] * first + [1] * (n - first)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        hidden = self.model.forward(as_tensor(ids), as_tensor(types), as_tensor(positions), lengths)
        return self.model.pool(hidden, lengths).cpu().tolist()

    def _output(self, req: EncodeRequest, vector: list[float] | None, reason: str, now: float) -> RequestOutput:
        n = len(req.token_ids)
        done = vector is not None
        stats = RequestStats(num_prompt_tokens=n, num_cached_tokens=0, num_prompt_tokens_computed=n if done else 0,
                             num_cache_written_tokens=0, num_output_tokens=0, num_preemptions=0,
                             arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                             first_token_time=None, prefill_done_time=now if done else None, finish_time=now,
                             token_times=[], num_prefill_chunks=1 if done else 0)
        return RequestOutput(req.request_id, "", [], "", [], True, reason, None, stats, MetaState.FINISHED,
                             embedding=vector)

    # ---- what its loop reads ------------------------------------------------------------------------
    def snapshot(self, rss_mb: float = 0.0, kv_blocks: KVBlocks | None = None) -> EngineSnapshot:
        steps = list(self.counts.steps)
        total = sum(s.step_s for s in steps)
        gpu = (round(torch.cuda.memory_allocated(self.device) / 2**20, 1) if self.device.type == "cuda" else None)
        return EngineSnapshot(alive=True, num_waiting=len(self.waiting), num_steps=self.counts.num_steps,
                              mean_step_s=total / len(steps) if steps else 0.0, threads=torch.get_num_threads(),
                              rss_mb=rss_mb, gpu_memory_allocated_mb=gpu, step=ENCODER_STEP)

    def enter_basic_mode(self, reason: str) -> None:
        log.error("an encoder has no basic mode to enter: %s", reason)

    def switch_kernels(self) -> bool:
        return False

    @property
    def is_preparing(self) -> bool:
        return False

    @property
    def works_in_background(self) -> bool:
        return False
