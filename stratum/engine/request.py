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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stratum.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance
    import torch

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
class CacheStats:
    """What the prefix cache did for one request's prompt, counted where it happened: tokens computed
    (the scheduler), tokens written to the cache (the block manager), tokens the disk tier served and
    the wait for them (the disk tier)."""

    num_prompt_tokens_computed: int = 0  # prompt tokens that went through the forward (recompute included)
    num_cache_written_tokens: int = 0  # prompt tokens this request added to the prefix cache
    num_disk_cached_tokens: int = 0  # of Sequence.num_cached_tokens, those read from the disk tier
    disk_read_s: float = 0.0  # how long the request waited for those reads


@dataclass(slots=True)
class SamplerState:
    """What sampling a request's rows reads besides its params: set when the request is added; the
    grammar's matcher (attached when its answer begins) and the forced tokens are the output
    processor's, advanced one accepted token at a time."""

    generator: "torch.Generator | None" = None  # a seeded request's own
    matcher: "llguidance.LLMatcher | None" = None  # a constrained request's grammar state
    is_low_latency: bool = False  # latency over accuracy: sampled from the fast (int8) output projection
    # what the engine writes next instead of sampling, a token a step (a thought's end marker at its budget)
    forced_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Readouts:
    """What the model runner reads out of the forward for a request, beyond its sampled tokens."""

    logits: "dict[int, torch.Tensor]" = field(default_factory=dict)  # position -> fp32 logits (return_logits)
    prompt_logprobs: dict[int, tuple] = field(default_factory=dict)  # prompt position -> (logprob, top)
    coverage_sum: float = 0.0  # attention coverage samples (kv_sparsity: layers.attention.attention_coverage)
    coverage_count: int = 0
    # an embedding request's pooling ("mean" | "last") and the final hidden states it reads: every prompt
    # position's row [prompt, hidden] for "mean" (a recomputed chunk writes its rows again), the last one's for
    # "last"; pooled when its prefill ends (`ModelRunner.pooled`)
    pooling: str | None = None
    hidden: "torch.Tensor | None" = None

    @property
    def kv_sparsity(self) -> float | None:
        return self.coverage_sum / self.coverage_count if self.coverage_count else None


@dataclass(slots=True)
class Sequence:
    """A request's scheduling state. Its records hang off it: what sampling reads (`SamplerState`),
    what the forward reads out (`Readouts`), what the cache did (`CacheStats`). The output side's state
    (detokenizer, stop rules, meta-state, times) is the output processor's (`OutputState`), and
    speculation's the speculator's (`SpecState`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_size: int
    priority: int = 0  # lower runs first, as in vLLM
    cache_salt: str | None = None
    cache_policy: CachePolicy = field(default_factory=CachePolicy)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule; -1 until then
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_inserted_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_reserved_tokens: int = 0  # tokens past the next one whose blocks are held ahead (a tool call's arguments)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    first_scheduled_time: float | None = None
    pin_prefixes: list[tuple[int, float]] = field(default_factory=list)  # (prompt tokens, ttl seconds) to pin
    fork_of: "Sequence | None" = None  # a sample of n: starts from this request's computed prompt (scheduler._fork)
    # speculative decoding (engine.spec_decode): the tokens proposed for the coming step, verified after
    # the last one in the same forward (empty: a plain decode)
    spec_token_ids: list[int] = field(default_factory=list)
    sampler: SamplerState = field(default_factory=SamplerState)
    readouts: Readouts = field(default_factory=Readouts)
    cache_stats: CacheStats = field(default_factory=CacheStats)

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
