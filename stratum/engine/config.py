"""Engine configuration: the settings a user gives (`EngineConfig`, with "auto" values) and the
configuration the engine runs with (`ResolvedConfig`, every value concrete).

`stratum.engine.builder.resolve` is the one step from the first to the second; `serve`, `info` and
the offline API all go through it, so nothing downstream reads "auto"."""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stratum.engine.sampling_params import SamplingParams
    from stratum.kernels import KernelPlan
    from stratum.kernels.numerics import Numerics


def host_free_memory() -> int:
    """The system's available memory in bytes, or what this process's memory cgroup still allows where
    that is less (a container's limit)."""
    import psutil

    free = psutil.virtual_memory().available
    for limit, usage in (("memory.max", "memory.current"),
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:  # cgroup v2, then v1, each as mounted in this process's namespace
            cap = (Path("/sys/fs/cgroup") / limit).read_text().strip()
            if cap != "max":
                free = min(free, int(cap) - int((Path("/sys/fs/cgroup") / usage).read_text()))
            break
        except (OSError, ValueError):
            continue
    return free


def configured_threads(num_threads: int | None = None) -> int:
    """The engine threads the user set: `--threads`, else $STRATUM_NUM_THREADS; 0 where neither is."""
    return num_threads or max(0, int(os.environ.get("STRATUM_NUM_THREADS", 0) or 0))


def default_threads(serving: bool, native_step: bool = False, replicas: int = 1) -> int:
    """Engine threads when `--threads` is not given: $STRATUM_NUM_THREADS, else every core; a server on
    the PyTorch step, or in front of several engine replicas, leaves one core to its HTTP side, and
    the replicas of one machine share the rest. The native step's kernel plan measures fewer below
    this (kernels/plan.py); every other step runs at this count.

    Measured on the 2-core reference machine: with the PyTorch step, 1 engine thread served 1.6x (one
    stream) and 1.16x (32 streams) the tokens/s of 2 threads, whose spin-waiting lost to the server's
    own work. With the native step it is the other way round (`stratum bench compare`, 2 threads
    over 1, Intel machine): 1.69x at one stream, 1.34x at 16 unique streams, 1.27x at 32 streams
    under a shared prompt and 1.27x on the multiturn workload.
    """
    if configured_threads():
        return configured_threads()
    cores = os.cpu_count() or 1
    spare = serving and (replicas > 1 or not native_step)
    return max(1, (cores - 1 if spare else cores) // replicas)


def default_prefill_threads(threads: int, replicas: int = 1) -> int:
    """Threads for prefill-heavy steps when `--prefill-threads` is not given: every core of this
    engine's share of the machine (the replicas of one machine share it), never fewer than `threads`."""
    return max(threads, (os.cpu_count() or 1) // replicas)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    max_num_batched_tokens: token budget per step (decodes + prefill chunks); the prefill chunk size.
    max_num_seqs: cap on running sequences (the decode batch).
    max_waiting: cap on the waiting queue; beyond it requests are rejected as overloaded.
    watermark_blocks: free blocks kept back when admitting new requests, so running ones can grow.
    max_itl_ms: while any request decodes, the most a step may cost by its measured cost model
        (`step_cost.StepCost`), so no decoding request waits longer for its next token; prefill chunks
        are sized to fit (at least `scheduler.MIN_PREFILL_CHUNK` tokens). 0: no time budget, the
        default here, for offline batches (`LLM`), where nobody waits on a token; `stratum serve`
        sets 200 ms (`--max-itl-ms`), chosen by measurement on the 2-core reference machine
        (docs/benchmarks.md).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 256
    watermark_blocks: int = 4
    max_itl_ms: float = 0.0


@dataclass(frozen=True)
class EngineConfig:
    """What a user sets; None and "auto" mean "decide for this machine and model" (see `builder.resolve`)."""

    model: str = "smollm2-135m"
    device: str = "auto"  # "cpu", "cuda", or "auto"
    dtype: str = "auto"  # "float32", "bfloat16", or "auto": the numerics rule's default (kernels/numerics.py)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_mb
    kv_cache_memory_mb: int | None = None  # None: the default pool (`builder.kv_pool_blocks`)
    max_model_len: int | None = None  # None: the checkpoint's context length (or what rope_scaling reaches)
    # RoPE scaling that extends the context beyond the trained one, as llama.cpp's --rope-scaling /
    # --rope-scale / --yarn-orig-ctx (`ModelConfig.with_context`); None: the trained context, at most
    rope_scaling: str | None = None
    rope_scale: float | None = None
    yarn_orig_ctx: int | None = None
    # whether the context above binds an encoder too: one served model, yes (a context it cannot reach is an
    # error); among several (`server.models.model_specs`) they are the generators', and an encoder keeps its own
    encoder_takes_context: bool = True
    enable_prefix_cache: bool = True
    # the disk tier under the prefix cache (`disk_tier`): GiB (None: $STRATUM_KV_DISK_GB, else a tenth of the
    # free disk, at most 16; 0: off) under kv_disk_dir (None: $STRATUM_HOME/kv)
    kv_disk_gb: float | None = None
    kv_disk_dir: str | None = None
    num_threads: int | None = None  # torch threads for decode-bound steps; None: `default_threads`
    # for steps of PREFILL_STEP_TOKENS tokens or more; None: `default_prefill_threads`
    prefill_threads: int | None = None
    replicas: int = 1  # engines of this machine that share its cores (`--replicas`)
    int4_max_tokens: int | None = None  # None: the numerics rule; 0: no packed weights (dense); N > 0: int4 copies
    # None: the numerics rule; True/False: the native step where the checkpoint allows / never
    native_step: bool | None = None
    # the native step's activation blocks: "int16" (the rule) or "int8" (llama.cpp's precision, faster where the
    # CPU's widest integer product is 8-bit; kernels/numerics.py)
    activations: str = "int16"
    remeasure_plan: bool = False  # measure the kernel plan again, even if one is cached (`stratum info --remeasure`)
    serving: bool = False  # a server leaves one core to its HTTP side by default
    # a start on a machine whose native kernels are not compiled yet serves on the provisional step at
    # once and compiles them in the background (`engine.prepare`), instead of waiting; `stratum serve` sets it
    defer_kernels: bool = False
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # speculative decoding (engine.spec_decode.SpecConfig): "auto" | "off" | "ngram" | "draft"
    speculative: str = "auto"
    num_speculative_tokens: int = 16  # the most tokens proposed per request and step
    prompt_lookup_min: int = 2  # the n-gram lengths prompt lookup matches
    prompt_lookup_max: int = 5
    draft_model: str | None = None  # a GGUF file or folder with the model's tokenizer
    # a decoder's embeddings (`--pooling`, as llama-server's): "mean" or "last" of the final hidden states;
    # None: it serves none (an encoder pools as its checkpoint says)
    pooling: str | None = None

    def to_json(self) -> str:
        """For another process of this runtime (the engine process, the preparing child)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        settings = json.loads(text)
        return cls(**{**settings, "scheduler": SchedulerConfig(**settings["scheduler"])})


@dataclass(frozen=True)
class ResolvedConfig:
    """The configuration an engine runs with: no "auto", no None.

    `numerics` is the one record of what decides the bits of the KV pool and the logits of the step
    that runs (kernels/numerics.py): anything keyed on computed values (KV kept across restarts, a
    draft's agreement with its verifier) keys on `numerics.key()`.
    """

    model: str
    device: str
    dtype: str  # the PyTorch layers' matmul dtype, "float32" | "bfloat16" (numerics.dtype)
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    enable_prefix_cache: bool
    num_threads: int
    prefill_threads: int
    kernel_plan: "KernelPlan"
    seed: int
    scheduler: SchedulerConfig
    default_temperature: float  # the model's recommended sampling, for requests that omit it
    default_top_p: float
    numerics: "Numerics"

    def check_request(self, num_prompt_tokens: int, sampling: "SamplingParams") -> None:
        """Raises InvalidRequestError when a request can never run here (too long, bad params)."""
        from stratum.engine.sampling_params import InvalidRequestError

        sampling.validate()
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty")
        total = num_prompt_tokens + sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds the context length of {self.max_model_len} tokens"
            )
        if -(-total // self.block_size) > self.num_kv_blocks:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens exceeds the KV pool ({self.num_kv_blocks} blocks "
                f"of {self.block_size})"
            )

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def torch_kv_dtype(self):
        """The KV pool's dtype (numerics.kv_dtype)."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.numerics.kv_dtype]
