"""BlockManager: exact block ids, reference counts, the prefix cache on top, and the block-state invariant.

Every test drives the manager the way the scheduler and engine do and calls check_integrity after
each change. The manager only hands out blocks; like the scheduler, the helpers here own the
accounting:

- admission (`admit`): match_prefix once, allocate with that match (the table starts with the hit),
  then count the hit as computed, and as cached on the first admission;
- later chunks and decode steps: allocate without a match after num_computed_tokens;
- commit: advance num_computed_tokens, then cache_computed_blocks;
- finish: cache_computed_blocks, then free.
"""

from __future__ import annotations

import pytest

from stratum.engine.request import CachePolicy
from tests.factories import make_block_manager, make_seq


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def matched_tokens(bm, seq) -> int:
    """Tokens of seq's prompt the prefix cache could serve now; 0 when seq does not read the cache."""
    match = bm.match_prefix(seq)
    return match.num_tokens(bm.block_size) if match is not None else 0


def admit(bm, seq, num_new_tokens: int | None = None) -> bool:
    """Admit a waiting seq as the scheduler's admission loop does: match once, allocate num_new_tokens
    (all that are left after the hit by default) with the match, then count the hit as computed, and
    as cached if this is the first admission. False, changing nothing, when allocation fails."""
    assert not seq.block_table, "only a waiting sequence (empty table) is admitted"
    match = bm.match_prefix(seq)
    hit = match.num_tokens(bm.block_size) if match is not None else 0
    if num_new_tokens is None:
        num_new_tokens = seq.num_tokens - hit
    if not bm.allocate(seq, num_new_tokens, match):
        return False
    seq.num_computed_tokens = hit
    if seq.num_cached_tokens < 0:
        seq.num_cached_tokens = hit
    return True


def compute(bm, seq, num_new_tokens: int | None = None) -> None:
    """Schedule and "compute" seq's next tokens (all that are left by default), then cache them: a
    waiting seq (empty table) is admitted, a running one allocates after num_computed_tokens."""
    waiting = not seq.block_table
    if waiting:
        assert admit(bm, seq, num_new_tokens)  # num_computed_tokens is now the hit
    if num_new_tokens is None:
        num_new_tokens = seq.num_tokens - seq.num_computed_tokens
    if not waiting:
        assert bm.allocate(seq, num_new_tokens)
    bm.check_integrity()
    seq.num_computed_tokens += num_new_tokens  # commit
    bm.cache_computed_blocks(seq)
    bm.check_integrity()


def decode(bm, seq, token: int) -> None:
    """Append a sampled token and compute it, as a running decode step does."""
    seq.token_ids.append(token)
    assert bm.allocate(seq, 1)
    bm.check_integrity()
    seq.num_computed_tokens += 1
    bm.cache_computed_blocks(seq)
    bm.check_integrity()


def finish(bm, seq) -> None:
    bm.cache_computed_blocks(seq)
    bm.free(seq)
    bm.check_integrity()


def states(bm) -> tuple[int, int, int]:
    return bm.num_free_blocks, bm.num_cached_blocks, bm.num_used_blocks


# ---- allocation and free ---------------------------------------------------------------------------


def test_allocate_gives_exact_block_ids_in_free_list_order():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(10))
    b = make_seq("b", range(100, 105))
    assert admit(bm, a, 10)
    bm.check_integrity()
    assert a.block_table == [0, 1, 2]
    assert a.num_cached_tokens == 0 and a.num_computed_tokens == 0
    assert admit(bm, b, 5)
    bm.check_integrity()
    assert b.block_table == [3, 4]
    assert bm.ref_counts == [1, 1, 1, 1, 1, 0, 0, 0]
    assert list(bm.free_blocks) == [5, 6, 7]
    assert states(bm) == (3, 0, 5)


def test_allocate_leaves_the_accounting_to_the_caller():
    """The manager hands out blocks only: num_computed_tokens / num_cached_tokens are the scheduler's,
    and without a match nothing is attached from the cache."""
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(9))
    compute(bm, a)
    finish(bm, a)
    assert sorted(bm.cache.block_node) == [0, 1] and list(bm.free_blocks) == [3, 4, 5, 6, 7, 2]

    b = make_seq("b", range(9))
    match = bm.match_prefix(b)
    assert match is not None and match.num_blocks == 2 and match.block_ids == [0, 1]
    assert bm.allocate(b, 1, match)
    bm.check_integrity()
    assert b.block_table == [0, 1, 3] and bm.ref_counts[:4] == [1, 1, 0, 1]
    assert b.num_computed_tokens == 0 and b.num_cached_tokens == -1  # untouched by the manager

    c = make_seq("c", range(9))  # same prompt, no match passed: fresh blocks after num_computed_tokens
    assert bm.allocate(c, 9)
    bm.check_integrity()
    assert c.block_table == [4, 5, 6] and bm.ref_counts[:2] == [1, 1]
    assert c.num_computed_tokens == 0 and c.num_cached_tokens == -1
    assert "c" not in bm._locked

    finish(bm, b)
    finish(bm, c)
    assert bm.ref_counts == [0] * 8 and sorted(bm.cache.block_node) == [0, 1]


def test_allocate_grows_one_block_at_each_boundary():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(8))
    compute(bm, a)
    assert a.block_table == [0, 1]
    grown = []
    for t in range(8, 17):
        a.token_ids.append(t)
        assert bm.allocate(a, 1)
        bm.check_integrity()
        a.num_computed_tokens += 1
        grown.append(list(a.block_table))
    # token 8 opens block 2, token 12 opens block 3, token 16 opens block 4
    assert [len(t) for t in grown] == [3, 3, 3, 3, 4, 4, 4, 4, 5]
    assert a.block_table == [0, 1, 2, 3, 4]


def test_chunked_allocation_counts_blocks_from_computed_tokens():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(14))
    assert bm.num_blocks_needed(a, 6) == 2
    compute(bm, a, 6)
    assert a.block_table == [0, 1]
    assert bm.num_blocks_needed(a, 6) == 1  # tokens 6..11 end in block 2
    compute(bm, a, 6)
    assert a.block_table == [0, 1, 2]
    compute(bm, a, 2)
    assert a.block_table == [0, 1, 2, 3]
    assert a.num_computed_tokens == 14


def test_failed_allocation_changes_nothing():
    bm = make_block_manager(num_blocks=4, block_size=4)
    a = make_seq("a", range(12))
    assert admit(bm, a, 12)
    b = make_seq("b", range(100, 108))
    assert not bm.can_allocate(2)
    assert not admit(bm, b, 8)
    bm.check_integrity()
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == -1
    assert list(bm.free_blocks) == [3]
    assert "b" not in bm._locked


def test_free_returns_blocks_to_the_tail_of_the_free_list():
    bm = make_block_manager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    a, b = make_seq("a", range(10)), make_seq("b", range(100, 105))
    compute(bm, a)
    compute(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    finish(bm, a)
    assert a.block_table == []
    assert list(bm.free_blocks) == [5, 6, 7, 0, 1, 2]
    assert states(bm) == (6, 0, 2)
    c = make_seq("c", range(200, 216))
    compute(bm, c)
    assert c.block_table == [5, 6, 7, 0]
    finish(bm, b)
    finish(bm, c)
    assert states(bm) == (8, 0, 0)


def test_basic_mode_neither_matches_nor_caches():
    bm = make_block_manager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    a = make_seq("a", range(12))
    compute(bm, a)
    finish(bm, a)
    b = make_seq("b", range(12))
    assert bm.match_prefix(b) is None  # basic mode does not read the cache at all
    compute(bm, b)
    assert b.num_cached_tokens == 0
    assert bm.cache.num_cached_blocks == 0


# ---- sharing a prefix --------------------------------------------------------------------------------


def test_two_sequences_share_a_prefix_with_reference_counts():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(12))
    compute(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.cache.num_cached_blocks == 3  # all three full blocks, still referenced by a

    b = make_seq("b", list(range(8)) + [50, 51, 52, 53, 54])
    assert matched_tokens(bm, b) == 8
    assert admit(bm, b, 5)
    bm.check_integrity()
    assert b.block_table == [0, 1, 3, 4]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.ref_counts[:5] == [2, 2, 1, 1, 1]
    b.num_computed_tokens = 13
    bm.cache_computed_blocks(b)
    bm.check_integrity()

    finish(bm, a)
    assert bm.ref_counts[:5] == [1, 1, 0, 1, 1]
    assert states(bm) == (3, 1, 4)  # block 2 (a's third block) is cached, unreferenced

    finish(bm, b)
    assert bm.ref_counts == [0] * 8
    # 0, 1 (shared), 2 (a's tail) and 3 (b's third block) stay cached; b's partial block 4 is freed
    assert sorted(bm.cache.block_node) == [0, 1, 2, 3]
    assert list(bm.free_blocks) == [5, 6, 7, 4]
    assert states(bm) == (4, 4, 0)


def test_a_prefix_hit_always_leaves_one_token_to_compute():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(8))
    compute(bm, a)
    finish(bm, a)
    assert sorted(bm.cache.block_node) == [0, 1]
    b = make_seq("b", range(8))
    # not 8: the last token must go through the forward for logits. Block 1 is cached, but b may read
    # only 3 of its slots: they are copied into a block of b's own, which computes the last slot.
    assert matched_tokens(bm, b) == 7
    match = bm.match_prefix(b)
    assert admit(bm, b, 1)
    assert b.block_table == [0, 2] and b.num_computed_tokens == 7
    assert bm.partial_copy(b, match) == (1, 2)


def test_generated_tokens_are_cached_so_the_next_turn_hits():
    bm = make_block_manager(num_blocks=16, block_size=4)
    a = make_seq("a", range(6))
    compute(bm, a)
    for t in range(100, 107):  # seven decode steps; the last sampled token is never computed
        decode(bm, a, t)
    a.token_ids.append(107)
    assert a.num_tokens == 14 and a.num_computed_tokens == 13
    table = list(a.block_table)
    finish(bm, a)
    assert sorted(bm.cache.block_node) == table[:3]  # 12 computed tokens in full blocks

    turn2 = make_seq("b", a.token_ids + [7, 8, 9])
    assert matched_tokens(bm, turn2) == 12
    assert admit(bm, turn2, 5)
    bm.check_integrity()
    assert turn2.block_table[:3] == table[:3]
    assert turn2.num_cached_tokens == 12


# ---- eviction ------------------------------------------------------------------------------------------


def test_eviction_takes_least_recently_used_first():
    clock = FakeClock()
    bm = make_block_manager(num_blocks=6, block_size=4, clock=clock)
    seqs = {}
    for t, name, base in ((1.0, "a", 0), (2.0, "b", 100), (3.0, "c", 200)):
        clock.t = t
        seqs[name] = make_seq(name, range(base, base + 5))  # one full block, one partial
        compute(bm, seqs[name])
        finish(bm, seqs[name])
    assert [s.block_table for s in seqs.values()] == [[], [], []]
    assert sorted(bm.cache.block_node) == [0, 2, 4]
    assert list(bm.free_blocks) == [1, 3, 5]

    clock.t = 4.0
    assert matched_tokens(bm, make_seq("a2", range(5))) == 4  # touches a's block: now most recent

    d = make_seq("d", range(300, 320))  # 5 blocks: 3 free + 2 evicted
    assert admit(bm, d, 20)
    bm.check_integrity()
    assert d.block_table == [1, 3, 5, 2, 4]  # b (t=2) evicted before c (t=3); a survives
    assert sorted(bm.cache.block_node) == [0]
    assert matched_tokens(bm, make_seq("a3", range(5))) == 4
    assert matched_tokens(bm, make_seq("b2", range(100, 105))) == 0


def test_a_locked_prefix_is_not_evicted():
    bm = make_block_manager(num_blocks=4, block_size=4)
    a = make_seq("a", range(9))
    compute(bm, a)
    finish(bm, a)
    assert sorted(bm.cache.block_node) == [0, 1] and list(bm.free_blocks) == [3, 2]

    b = make_seq("b", range(9))  # hits both blocks and holds them
    compute(bm, b)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_counts == [1, 1, 0, 1]
    c = make_seq("c", range(100, 108))
    assert not bm.can_allocate(2)
    assert not admit(bm, c, 8)
    bm.check_integrity()
    assert sorted(bm.cache.block_node) == [0, 1]

    finish(bm, b)
    assert bm.can_allocate(4)
    assert admit(bm, c, 8)
    bm.check_integrity()
    assert c.block_table == [2, 3]


def test_a_matched_prefix_is_locked_before_eviction_for_the_rest():
    """The hit must not be evicted to make room for the same request's new blocks."""
    bm = make_block_manager(num_blocks=4, block_size=4)
    a = make_seq("a", range(9))
    compute(bm, a)
    finish(bm, a)
    filler = make_seq("f", range(100, 108))
    compute(bm, filler)  # takes the two free blocks
    assert filler.block_table == [3, 2]
    b = make_seq("b", list(range(8)) + [60, 61, 62, 63, 64])  # hits 2 blocks, needs 2 more
    assert matched_tokens(bm, b) == 8
    assert not admit(bm, b, 5)
    bm.check_integrity()
    assert sorted(bm.cache.block_node) == [0, 1, 2, 3]
    assert bm.ref_counts == [0, 0, 1, 1] and list(bm.free_blocks) == []  # the lock was undone
    assert b.block_table == [] and "b" not in bm._locked


def test_pinned_prefix_survives_until_its_ttl_expires():
    clock = FakeClock()
    bm = make_block_manager(num_blocks=4, block_size=4, clock=clock)
    a = make_seq("a", range(9), policy=CachePolicy(pin_ttl_s=10.0))
    assert admit(bm, a, 9)
    a.num_computed_tokens = 9
    bm.cache_computed_blocks(a, pin_ttl_s=a.cache_policy.pin_ttl_s)
    bm.check_integrity()
    finish(bm, a)
    assert sorted(bm.cache.block_node) == [0, 1]

    big = make_seq("big", range(100, 116))  # needs all 4 blocks
    clock.t = 9.9
    assert bm.cache.num_evictable_blocks() == 0
    assert not bm.can_allocate(4)
    assert not admit(bm, big, 16)
    bm.check_integrity()
    assert sorted(bm.cache.block_node) == [0, 1]

    clock.t = 10.0
    assert bm.cache.num_evictable_blocks() == 2
    assert admit(bm, big, 16)
    bm.check_integrity()
    assert big.block_table == [3, 2, 1, 0]  # free list first, then the evicted leaf tail first
    assert bm.cache.num_cached_blocks == 0


def test_a_pin_applies_to_a_prefix_that_was_already_cached():
    """A request asking to pin its prompt pins it even when another request cached the blocks first."""
    clock = FakeClock()
    bm = make_block_manager(num_blocks=4, block_size=4, clock=clock)
    a = make_seq("a", range(9))  # caches blocks 0, 1 without a pin
    compute(bm, a)
    finish(bm, a)
    b = make_seq("b", range(9), policy=CachePolicy(pin_ttl_s=10.0))
    assert admit(bm, b, 1)
    assert b.block_table[:2] == [0, 1] and b.num_cached_tokens == 8
    b.num_computed_tokens = 9
    bm.cache_computed_blocks(b, pin_ttl_s=b.cache_policy.pin_ttl_s)
    finish(bm, b)
    clock.t = 5.0
    assert bm.cache.num_evictable_blocks() == 0
    assert not admit(bm, make_seq("big", range(100, 116)), 16)
    clock.t = 10.0
    assert bm.cache.num_evictable_blocks() == 2


def test_reset_prefix_cache_frees_only_unreferenced_blocks():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(9))
    compute(bm, a)
    finish(bm, a)
    b = make_seq("b", range(100, 109))
    compute(bm, b)  # running, its two full blocks are cached and referenced
    assert bm.reset_prefix_cache() == 2
    bm.check_integrity()
    assert sorted(bm.cache.block_node) == b.block_table[:2]
    assert matched_tokens(bm, make_seq("a2", range(9))) == 0


# ---- salt isolation (CVE-2025-25183, CVE-2025-46570 class) -------------------------------------------


def test_same_tokens_with_a_different_salt_never_hit():
    bm = make_block_manager(num_blocks=16, block_size=4)
    a = make_seq("a", range(13), salt="tenant-a")
    compute(bm, a)
    finish(bm, a)
    assert bm.cache.num_cached_blocks == 3

    for other_salt in ("tenant-b", None, ""):
        other = make_seq(f"x-{other_salt}", range(13), salt=other_salt)
        assert matched_tokens(bm, other) == 0
        assert not set(other.full_block_hashes()) & set(a.full_block_hashes())
    b = make_seq("b", range(13), salt="tenant-b")
    compute(bm, b)
    assert b.num_cached_tokens == 0
    assert not set(b.block_table) & {0, 1, 2}

    same = make_seq("a2", range(13), salt="tenant-a")
    assert matched_tokens(bm, same) == 12
    compute(bm, same)
    assert same.block_table[:3] == [0, 1, 2] and same.num_cached_tokens == 12


def test_cache_policy_bypass_neither_reads_nor_writes():
    bm = make_block_manager(num_blocks=8, block_size=4)
    a = make_seq("a", range(9))
    compute(bm, a)
    finish(bm, a)
    b = make_seq("b", range(9), policy=CachePolicy.bypass())
    assert bm.match_prefix(b) is None  # a bypass request does not read the cache at all
    compute(bm, b)
    assert b.num_cached_tokens == 0
    finish(bm, b)
    assert sorted(bm.cache.block_node) == [0, 1]  # b's copies went back to the free list
    c = make_seq("c", range(100, 109), policy=CachePolicy(read=True, write=False))
    compute(bm, c)
    finish(bm, c)
    assert sorted(bm.cache.block_node) == [0, 1]


# ---- the invariant -------------------------------------------------------------------------------------


def test_free_plus_cached_plus_in_use_is_total_throughout():
    clock = FakeClock()
    bm = make_block_manager(num_blocks=12, block_size=4, clock=clock)
    live = []
    for i in range(6):
        clock.t = float(i)
        seq = make_seq(f"s{i}", list(range(8)) + [100 + i] * (3 + i))  # shared 2-block prefix
        compute(bm, seq)
        live.append(seq)
        free, cached, used = states(bm)
        assert free + cached + used == 12
        if len(live) == 3:
            for s in live:
                finish(bm, s)
            live = []
    for s in live:
        finish(bm, s)
    free, cached, used = states(bm)
    assert used == 0 and free + cached == 12


def test_check_integrity_catches_a_block_in_two_states():
    bm = make_block_manager(num_blocks=4, block_size=4)
    a = make_seq("a", range(6))
    compute(bm, a)
    bm.free_blocks.append(a.block_table[0])  # in use and free at once
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_check_integrity_catches_a_leaked_block():
    bm = make_block_manager(num_blocks=4, block_size=4)
    bm.free_blocks.popleft()  # neither free, cached nor in use
    with pytest.raises(AssertionError, match="total"):
        bm.check_integrity()
