"""Engine configuration: frozen dataclasses, with every "auto" resolved once in `resolve()`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    max_num_batched_tokens: token budget per step (decodes + prefill chunks); the prefill chunk size.
    max_num_seqs: cap on running sequences (the decode batch).
    max_waiting: cap on the waiting queue; beyond it requests are rejected as overloaded.
    watermark_blocks: free blocks kept back when admitting new requests, so running ones can grow.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_waiting: int = 256
    watermark_blocks: int = 4


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    device: str = "auto"  # "cpu", "cuda", or "auto"
    dtype: str = "auto"  # "float32", "bfloat16", or "auto" (CUDA: bf16; CPU: whichever measures faster)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_mb
    kv_cache_memory_mb: int = 256
    max_model_len: int | None = None  # None: the checkpoint's context length, capped at 8192
    enable_prefix_cache: bool = True
    num_threads: int | None = None  # torch threads for decode-bound steps
    prefill_threads: int | None = None  # for steps with at least PREFILL_STEP_TOKENS tokens; None: every core
    int4_max_tokens: int | None = None  # None: measured (layers.kernels); 0: never pack; N: packed int4 up to N rows
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def resolve(self) -> "EngineConfig":
        """Turn every "auto" into a concrete value for this machine."""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype  # "auto" on CPU is decided by the measured kernel plan (layers.kernels)
        if dtype == "auto" and device == "cuda":
            dtype = "bfloat16"
        threads = self.num_threads or int(os.environ.get("STRATUM_NUM_THREADS", 0)) or (os.cpu_count() or 1)
        prefill_threads = self.prefill_threads or max(threads, int(os.environ.get("STRATUM_NUM_THREADS", 0)) or (os.cpu_count() or 1))
        return replace(self, device=device, dtype=dtype, num_threads=threads, prefill_threads=prefill_threads)

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
