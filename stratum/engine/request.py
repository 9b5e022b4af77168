"""A request inside the runtime: plain state, advanced by the scheduler and the engine.

One accounting rule drives everything: `num_computed_tokens` catches up with `num_tokens`.
A new request starts at its prefix-cache hit; chunked prefill advances it by the chunk; a
running decode sits at num_tokens - 1; recompute preemption resets it to 0. The scheduler is the
only writer of it.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import struct
import time
from dataclasses import dataclass, field

from stratum.engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How one request uses the prefix cache.

    read: match its prompt against the cache. write: insert its computed blocks.
    pin_ttl_s: keep the inserted prefix (prompt, and output if pin_output) unevictable this long.
    """

    read: bool = True
    write: bool = True
    pin_ttl_s: float = 0.0
    pin_output: bool = False

    @classmethod
    def bypass(cls) -> "CachePolicy":
        return cls(read=False, write=False)


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained SHA-256 key of one full block: H(parent key || little-endian uint32 token ids)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def short_key(key: bytes) -> int:
    """The first 8 bytes of a block key as an integer: how the cache's contents are told to a router."""
    return int.from_bytes(key[:8], "little")


def prompt_block_keys(token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """Short keys of the full prompt blocks a cache hit may cover (one token is always left to compute):
    the same chain, salt included, that `Sequence.full_block_hashes` builds in the engine."""
    keys, parent = [], root_hash(salt)
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(short_key(parent))
    return keys


def root_hash(salt: str | None) -> bytes:
    """The chain's seed. A per-tenant salt makes every key of that tenant distinct from everyone else's."""
    return hashlib.sha256(b"stratum-prefix-v1:" + (salt or "").encode()).digest()


@dataclass(slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_size: int
    priority: int = 0  # lower runs first, as in vLLM
    is_low_latency: bool = False  # latency over accuracy: sampled from the fast (int8) output projection
    cache_salt: str | None = None
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule; -1 until then
    num_cache_written_tokens: int = 0  # prompt tokens this request added to the prefix cache
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those read from the disk tier (`disk_tier`)
    disk_read_s: float = 0.0  # how long the request waited for those reads
    num_prompt_tokens_computed: int = 0  # prompt tokens that went through the forward (recompute included)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_inserted_blocks: int = 0  # leading blocks already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prefill_done_time: float | None = None  # the step that computed the last prompt token ended
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    # Telemetry, produced by the code that does the work:
    state: str = "queued"  # the meta-token state machine: queued, prefill_chunk_k, prefill_complete, decode_step_N, tool_use_prepared, finished
    num_prefill_chunks: int = 0
    coverage_sum: float = 0.0  # attention coverage samples (kv_sparsity), see layers.attention.attention_coverage
    coverage_count: int = 0
    kv_bytes_at_first_token: int = 0
    tool_marker: str | None = None  # text that starts a tool call; seen in the output -> tool_use_prepared
    is_tool_prepared: bool = False
    num_tool_reserved_tokens: int = 0
    pin_prefixes: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, ttl seconds) to pin once computed
    logits: dict[int, object] = field(default_factory=dict)  # position -> fp32 logits, only with return_logits
    generator: object | None = None  # torch.Generator for seeded sampling
    fork_of: "Sequence | None" = None  # a sample of n: starts from this request's computed prompt (scheduler._fork)
    matcher: object | None = None  # the grammar's state (llguidance LLMatcher), for constrained requests
    logprobs: list = field(default_factory=list)  # per output token, when sampling.logprobs is set
    prompt_logprobs: dict = field(default_factory=dict)  # prompt position -> (logprob, top), with sampling.prompt_logprobs
    # Speculative decoding (engine.spec_decode): the tokens proposed for the coming step, verified
    # after the last token in the same forward (empty: a plain decode), and the request's proposer state
    spec_token_ids: list[int] = field(default_factory=list)
    spec: object | None = None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def kv_sparsity(self) -> float | None:
        return self.coverage_sum / self.coverage_count if self.coverage_count else None

    def kv_cache_efficiency(self, block_size: int) -> float:
        """Tokens held in KV ÷ slots in the blocks allocated to this request."""
        slots = len(self.block_table) * block_size
        return self.num_computed_tokens / slots if slots else 0.0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """All but the last token is computed: the next step computes one token and samples from it.
        The one definition of a decode."""
        return 0 < self.num_computed_tokens == self.num_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return not self.is_decoding

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_order)

    def full_block_hashes(self) -> list[bytes]:
        """Chained keys of every full block of token_ids, extended incrementally."""
        bs = self.block_size
        num_full = self.num_tokens // bs
        hashes = self.block_hashes
        parent = hashes[-1] if hashes else root_hash(self.cache_salt)
        for i in range(len(hashes), num_full):
            parent = hash_block(parent, self.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes
