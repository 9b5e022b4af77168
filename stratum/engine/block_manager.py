"""Paged KV blocks: reference counts, a free list, and the radix prefix cache on top.

Every block is in exactly one of three states; `check_integrity` asserts it:

    | state    | ref_count | in radix tree | where it is           |
    |----------|-----------|---------------|-----------------------|
    | free     | 0         | no            | free list             |
    | cached   | 0         | yes           | tree (evictable/pinned)|
    | in use   | > 0       | maybe         | some block tables     |

    free + cached + in use == total
"""

from __future__ import annotations

import math
from collections import deque

from typing import TYPE_CHECKING

from stratum.engine.radix_cache import MatchResult, RadixCache
from stratum.engine.request import Sequence

if TYPE_CHECKING:
    from stratum.engine.disk_tier import DiskTier


class BlockManager:
    """Allocates blocks to sequences, sharing cached prefixes through the radix tree.

    Args:
        num_blocks: size of the KV pool in blocks.
        block_size: tokens per block.
        enable_prefix_cache: when False, nothing is matched or inserted (basic mode).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True, clock=None,
                 fault: str | None = None):
        self.num_blocks = num_blocks
        self.fault = fault  # "cache": prefix-cache lookups raise, to test the degraded mode
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.cache = RadixCache(self.ref_counts, clock) if clock else RadixCache(self.ref_counts)
        self._locked = {}  # request_id -> (radix node it holds references through, how many blocks that is)
        # the tier under the prefix cache that continues a match the pool misses (`DiskTier.attach`)
        self.tier: DiskTier | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return sum(1 for r in self.ref_counts if r > 0)

    @property
    def num_cached_blocks(self) -> int:
        return sum(1 for b in self.cache.block_node if self.ref_counts[b] == 0)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = math.ceil((seq.num_computed_tokens + num_new_tokens) / self.block_size)
        return max(0, total - len(seq.block_table))

    def num_blocks_needed_for(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        if num_blocks <= len(self.free_blocks):
            return True
        return num_blocks <= len(self.free_blocks) + self.cache.num_evictable_blocks()

    def match_prefix(self, seq: Sequence) -> MatchResult | None:
        """The cached blocks that could serve seq's prompt now (no side effects beyond LRU and edge
        splits); None when seq does not read the cache. At least one token is always left to compute,
        so the step produces logits. Pass the match to `allocate` in the same step."""
        if not (self.enable_prefix_cache and seq.cache_policy.read):
            return None
        if self.fault == "cache":
            raise RuntimeError("injected prefix-cache fault (STRATUM_FAULT_INJECT=cache)")
        match = self.cache.match_prefix(self._prefix_keys(seq))
        if not match.num_blocks:  # a partial match needs a full one before it: the root's children are
            return match          # every tenant's first blocks, and one tenant never reads another's
        bs, start = self.block_size, match.num_blocks * self.block_size
        block, n = self.cache.match_partial(match.node, seq.token_ids[start : min(start + bs, seq.num_tokens - 1)])
        return match._replace(partial_block=block, partial_tokens=n) if n else match

    def expected_cached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens the cache would serve seq now, its lower tier's included: what it will read when
        it is scheduled, unless blocks are evicted or computed meanwhile."""
        match = self.match_prefix(seq)
        if match is None:
            return 0
        on_disk = self.tier.expected_blocks(seq, match) if self.tier is not None else 0
        return (match.num_blocks + on_disk) * self.block_size if on_disk else match.num_tokens(self.block_size)

    def is_loading(self, seq: Sequence, match: MatchResult | None, reserve: int) -> bool:
        """Whether seq waits for its prefix to be read from the tier under the cache: a read of the
        blocks after match is in flight, or has just started (keeping `reserve` blocks free)."""
        return self.tier is not None and self.tier.holds_back(seq, match, reserve)

    def poll_tiers(self) -> None:
        """Blocks the tier under the cache has read since the last step join the tree."""
        if self.tier is not None:
            self.tier.poll()

    def admitted(self, seq: Sequence, match: MatchResult | None, first: bool) -> None:
        """seq was given its blocks for match (at its first admission when first)."""
        if self.tier is not None:
            self.tier.admitted(seq, match, first)

    # ---- changes -------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, match: MatchResult | None = None) -> bool:
        """Give seq blocks for its next num_new_tokens.

        With a match (a waiting request's first allocation), seq's table starts with the matched
        blocks, shared and locked, and the new tokens follow them; the caller then counts the matched
        tokens as computed. A partial match's slots are copied into seq's next block, its own: the
        caller queues that copy (`partial_copy`) before the step. Without a match, the new tokens
        follow seq.num_computed_tokens.

        Returns:
            False, changing nothing, when the pool cannot supply the blocks even after eviction.
        """
        if match is not None and match.num_blocks and not seq.block_table:
            needed = -(-(match.num_tokens(self.block_size) + num_new_tokens) // self.block_size) - match.num_blocks
            self.cache.lock(match.node)  # protect the hit before evicting for the rest
            if not self._reserve(needed):
                self.cache.unlock(match.node)
                return False
            self._locked[seq.request_id] = (match.node, match.num_blocks)
            seq.block_table = list(match.block_ids)
            seq.num_inserted_blocks = match.num_blocks
        else:
            needed = self.num_blocks_needed(seq, num_new_tokens)
            if not self._reserve(needed):
                return False
        for _ in range(needed):
            b = self.free_blocks.popleft()
            self.ref_counts[b] = 1
            seq.block_table.append(b)
        return True

    @staticmethod
    def partial_copy(seq: Sequence, match: MatchResult | None) -> tuple[int, int] | None:
        """After `allocate` with match: the (source, destination) block copy that gives seq the partial
        match's slots, or None."""
        if match is None or not match.partial_tokens:
            return None
        return (match.partial_block, seq.block_table[match.num_blocks])

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give child (a sample of parent's prompt) parent's blocks for every prompt position before the
        last, shared, and a block of its own from there on: a copy of parent's block when that block
        already holds some of those positions. Call after `can_allocate(1)`.

        Returns:
            (source, destination) block to copy before the next step, or None when there is nothing to copy.
        """
        last = child.num_prompt_tokens - 1  # the position the child computes itself
        num_shared = last // self.block_size
        shared = parent.block_table[:num_shared]
        for b in shared:
            self.ref_counts[b] += 1
        assert self._reserve(1), "fork without a free block"
        own = self.free_blocks.popleft()
        self.ref_counts[own] = 1
        child.block_table = shared + [own]
        child.num_inserted_blocks = min(num_shared, parent.num_inserted_blocks)
        return (parent.block_table[num_shared], own) if last % self.block_size else None

    def cache_computed_blocks(self, seq: Sequence, pin_ttl_s: float = 0.0) -> None:
        """Offer seq's newly computed full blocks to the prefix cache (prompt and output alike)."""
        if not (self.enable_prefix_cache and seq.cache_policy.write):
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_inserted_blocks:
            if pin_ttl_s > 0 and num_full:  # nothing new, but a prefix served by the cache is pinned all the same
                self.cache.pin(seq.full_block_hashes()[:num_full], pin_ttl_s)
            return
        keys = seq.full_block_hashes()[:num_full]
        bs, ids = self.block_size, seq.token_ids
        num_present = self.cache.insert(keys, seq.block_table[:num_full], tokens=lambda i: ids[i * bs : (i + 1) * bs])
        num_prompt_blocks = seq.num_prompt_tokens // self.block_size
        seq.cache_stats.num_cache_written_tokens += (max(0, min(num_full, num_prompt_blocks) - num_present)
                                                     * self.block_size)
        seq.num_inserted_blocks = num_full
        if pin_ttl_s > 0:
            self.cache.pin(keys, pin_ttl_s)

    def free(self, seq: Sequence) -> None:
        """Return every block of seq. Blocks the cache holds stay cached; the rest go to the free list;
        nothing the tier under the cache reads stays held for it."""
        if self.tier is not None:
            self.tier.forget(seq)
        node, num_locked = self._locked.pop(seq.request_id, (None, 0))
        if node is not None:  # the cached prefix: references held through the tree path
            self.cache.unlock(node)
        for b in seq.block_table[num_locked:]:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0 and not self.cache.contains_block(b):
                self.free_blocks.append(b)
        seq.block_table = []
        seq.num_inserted_blocks = 0

    def take_blocks(self, num_blocks: int) -> list[int] | None:
        """num_blocks blocks of no sequence, held (one reference each) until `release_blocks`: the disk
        tier reads cached blocks into them. None, changing nothing, when the pool cannot supply them."""
        if num_blocks <= 0 or not self._reserve(num_blocks):
            return None
        taken = [self.free_blocks.popleft() for _ in range(num_blocks)]
        for b in taken:
            self.ref_counts[b] = 1
        return taken

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop `take_blocks`' references: a block the prefix tree took stays cached, the rest are free."""
        for b in block_ids:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0
            if self.ref_counts[b] == 0 and not self.cache.contains_block(b):
                self.free_blocks.append(b)

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """Return seq's blocks past its first num_blocks: blocks it alone holds, never cached (the
        lookahead of a verify step whose proposals were rejected)."""
        for b in seq.block_table[num_blocks:]:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] == 0 and not self.cache.contains_block(b), f"truncating shared block {b}"
            self.free_blocks.append(b)
        del seq.block_table[num_blocks:]

    def reset_prefix_cache(self) -> int:
        """Evict every unreferenced cached block. Returns how many were freed."""
        freed = self.cache.reset()
        self.free_blocks.extend(freed)
        return len(freed)

    def _prefix_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the full prompt blocks a cache hit may cover: one token is always left to compute."""
        return seq.full_block_hashes()[: (seq.num_tokens - 1) // self.block_size]

    def _reserve(self, num_blocks: int) -> bool:
        if num_blocks <= len(self.free_blocks):
            return True
        if not self.can_allocate(num_blocks):
            return False
        self.free_blocks.extend(self.cache.evict(num_blocks - len(self.free_blocks)))
        return num_blocks <= len(self.free_blocks)

    def check_integrity(self) -> None:
        """Assert free + cached + in use == total, with no block in two states."""
        self.cache.check_integrity()
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        cached = {b for b in self.cache.block_node if self.ref_counts[b] == 0}
        in_use = {b for b, r in enumerate(self.ref_counts) if r > 0}
        assert all(r >= 0 for r in self.ref_counts)
        assert not free & cached and not free & in_use, "a free block is also cached or in use"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + in use {len(in_use)} != total {self.num_blocks}"
        )

