"""RadixCache on its own: exact node structure after splits, LRU eviction order, locks, pins, salts.

Reference counts are a plain list here, standing in for the block manager's.
"""

from __future__ import annotations

import pytest

from stratum.engine.radix_cache import RadixCache
from stratum.engine.request import hash_block, root_hash

BS = 4


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """Chained keys of every full block of tokens, as Sequence.full_block_hashes computes them."""
    keys, parent = [], root_hash(salt)
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        keys.append(parent)
    return keys


def make_cache(num_blocks: int = 16, clock=None) -> RadixCache:
    cache = RadixCache([0] * num_blocks, clock or FakeClock())
    cache.check_integrity()
    return cache


def edges(node) -> list[tuple[list[int], list]]:
    """The tree below node as (blocks, children) pairs, children ordered by their first block."""
    return sorted(([c.blocks, edges(c)] for c in node.children.values()), key=lambda e: e[0][0])


A = list(range(16))  # four blocks
A_KEYS = chain(A)


def test_insert_then_match_the_whole_prefix():
    cache = make_cache()
    assert cache.insert(A_KEYS, [0, 1, 2, 3]) == 0
    cache.check_integrity()
    assert edges(cache.root) == [[[0, 1, 2, 3], []]]  # one edge holding four blocks
    m = cache.match_prefix(A_KEYS)
    assert m.block_ids == [0, 1, 2, 3] and m.num_blocks == 4
    assert m.node.blocks == [0, 1, 2, 3]
    assert cache.insert(A_KEYS, [7, 8, 9, 10]) == 4  # already cached: the caller keeps its copies
    cache.check_integrity()
    assert sorted(cache.block_node) == [0, 1, 2, 3]


def test_partial_match_splits_the_edge_exactly():
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    m = cache.match_prefix(A_KEYS[:2] + chain(list(range(8)) + [99, 99, 99, 99])[2:])
    cache.check_integrity()
    assert m.block_ids == [0, 1]
    assert m.node.keys == A_KEYS[:2] and m.node.blocks == [0, 1]
    assert m.node.parent is cache.root
    (lower,) = m.node.children.values()
    assert lower.keys == A_KEYS[2:] and lower.blocks == [2, 3] and lower.parent is m.node
    assert edges(cache.root) == [[[0, 1], [[[2, 3], []]]]]
    assert cache.block_node[1] is m.node and cache.block_node[2] is lower


def test_insert_diverging_prefix_splits_and_branches():
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    b_keys = chain(list(range(8)) + list(range(50, 62)))  # shares blocks 0-1, then 3 new blocks
    assert cache.insert(b_keys, [0, 1, 4, 5, 6]) == 2
    cache.check_integrity()
    assert edges(cache.root) == [[[0, 1], [[[2, 3], []], [[4, 5, 6], []]]]]
    upper = cache.block_node[0]
    assert set(upper.children) == {A_KEYS[2], b_keys[2]}
    assert cache.match_prefix(b_keys).block_ids == [0, 1, 4, 5, 6]
    assert cache.match_prefix(A_KEYS).block_ids == [0, 1, 2, 3]
    c_keys = chain(list(range(8)) + list(range(50, 54)) + [77] * 4)  # splits the new branch after one block
    assert cache.insert(c_keys, [0, 1, 4, 9]) == 3
    cache.check_integrity()
    assert edges(cache.root) == [[[0, 1], [[[2, 3], []], [[4], [[[5, 6], []], [[9], []]]]]]]


def test_a_key_chain_never_matches_out_of_position():
    """Block 2 of one prompt equals block 0 of another by tokens, but not by chained key."""
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    shifted = chain(A[8:12] + A[12:16])
    assert cache.match_prefix(shifted).num_blocks == 0


def test_eviction_is_lru_by_leaf_tail_first_and_parents_after_children():
    clock = FakeClock()
    cache = make_cache(clock=clock)
    clock.t = 1.0
    cache.insert(A_KEYS, [0, 1, 2, 3])
    clock.t = 2.0
    b_keys = chain(list(range(8)) + list(range(50, 58)))
    cache.insert(b_keys, [0, 1, 4, 5])  # touches the shared [0, 1] too
    clock.t = 3.0
    c_keys = chain(list(range(200, 208)))
    cache.insert(c_keys, [6, 7])
    assert cache.num_evictable_blocks() == 8

    assert cache.evict(1) == [3, 2]  # the oldest leaf goes whole, its blocks tail first
    cache.check_integrity()
    assert edges(cache.root) == [[[0, 1], [[[4, 5], []]]], [[6, 7], []]]
    assert cache.evict(1) == [5, 4]
    cache.check_integrity()
    # [0, 1] is now a leaf last touched at t=2, older than [6, 7] at t=3
    assert cache.evict(3) == [1, 0, 7, 6]
    cache.check_integrity()
    assert cache.num_cached_blocks == 0 and cache.root.children == {}
    assert cache.evict(1) == []


def test_a_match_refreshes_recency():
    clock = FakeClock()
    cache = make_cache(clock=clock)
    clock.t = 1.0
    cache.insert(A_KEYS[:1], [0])
    clock.t = 2.0
    b_keys = chain(list(range(100, 104)))
    cache.insert(b_keys, [1])
    clock.t = 3.0
    cache.match_prefix(A_KEYS[:1])
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [0]


def test_lock_prevents_eviction_of_the_whole_path():
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    b_keys = chain(list(range(8)) + list(range(50, 54)))
    cache.insert(b_keys, [0, 1, 4])
    m = cache.match_prefix(A_KEYS)
    cache.lock(m.node)
    assert cache.ref_counts[:5] == [1, 1, 1, 1, 0]
    assert cache.num_evictable_blocks() == 1  # only the sibling branch [4]
    assert cache.evict(10) == [4]
    cache.check_integrity()
    assert cache.evict(10) == []
    assert sorted(cache.block_node) == [0, 1, 2, 3]
    cache.unlock(m.node)
    assert cache.ref_counts[:4] == [0, 0, 0, 0]
    assert cache.evict(10) == [3, 2, 1, 0]
    cache.check_integrity()


def test_a_lock_survives_a_later_split_of_its_edge():
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    m = cache.match_prefix(A_KEYS)
    cache.lock(m.node)
    cache.match_prefix(A_KEYS[:1])  # splits the locked edge above the locked node
    cache.check_integrity()
    assert cache.evict(10) == []
    cache.unlock(m.node)  # the same node object still reaches every block through its parent
    assert cache.ref_counts[:4] == [0, 0, 0, 0]
    assert cache.evict(10) == [3, 2, 1, 0]


def test_pin_expires_with_its_ttl():
    clock = FakeClock()
    cache = make_cache(clock=clock)
    cache.insert(A_KEYS, [0, 1, 2, 3])
    clock.t = 100.0
    assert cache.pin(A_KEYS[:2], ttl_s=5.0) == 2  # pins the upper half, splitting the edge
    cache.check_integrity()
    # the unpinned lower half is evictable, the pinned node is not
    assert cache.num_evictable_blocks() == 2
    assert cache.evict(10) == [3, 2]
    clock.t = 104.9
    assert cache.evict(10) == []
    clock.t = 105.0
    assert cache.num_evictable_blocks() == 2
    assert cache.evict(10) == [1, 0]


def test_a_pin_is_kept_by_both_halves_of_a_split():
    clock = FakeClock()
    cache = make_cache(clock=clock)
    cache.insert(A_KEYS, [0, 1, 2, 3])
    cache.pin(A_KEYS, ttl_s=10.0)
    cache.match_prefix(A_KEYS[:1])  # split after the first block
    cache.check_integrity()
    clock.t = 9.0
    assert cache.num_evictable_blocks() == 0 and cache.evict(10) == []
    clock.t = 10.0
    assert cache.evict(10) == [3, 2, 1, 0]


def test_a_pinned_child_keeps_its_parent_and_a_pin_does_not_shorten():
    clock = FakeClock()
    cache = make_cache(clock=clock)
    cache.insert(A_KEYS, [0, 1, 2, 3])
    cache.pin(A_KEYS, ttl_s=50.0)
    cache.pin(A_KEYS, ttl_s=1.0)  # a shorter pin never cuts a longer one
    clock.t = 20.0
    assert cache.num_evictable_blocks() == 0
    assert cache.match_prefix(A_KEYS).node.pin_until == 50.0


def test_different_salts_share_nothing():
    cache = make_cache()
    cache.insert(chain(A, salt="tenant-a"), [0, 1, 2, 3])
    assert cache.match_prefix(chain(A, salt="tenant-b")).num_blocks == 0
    assert cache.match_prefix(chain(A, salt=None)).num_blocks == 0
    assert cache.match_prefix(chain(A, salt="tenant-a")).num_blocks == 4
    assert cache.insert(chain(A, salt="tenant-b"), [4, 5, 6, 7]) == 0
    cache.check_integrity()
    assert edges(cache.root) == [[[0, 1, 2, 3], []], [[4, 5, 6, 7], []]]


def test_reset_drops_everything_unreferenced():
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    c_keys = chain(list(range(200, 208)))
    cache.insert(c_keys, [6, 7])
    cache.lock(cache.match_prefix(c_keys).node)
    assert sorted(cache.reset()) == [0, 1, 2, 3]
    cache.check_integrity()
    assert sorted(cache.block_node) == [6, 7]


def test_check_integrity_catches_a_mis_indexed_block():
    cache = make_cache()
    cache.insert(A_KEYS, [0, 1, 2, 3])
    del cache.block_node[2]
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_recent_keys_are_whole_prefixes_most_recent_first():
    """What a replica tells a router it holds: bounded, and never a block without the blocks before it."""
    clock = FakeClock()
    cache = make_cache(clock=clock)
    b = [100 + t for t in range(12)]  # three blocks of its own
    cache.insert(A_KEYS, [0, 1, 2, 3])
    clock.t = 1.0
    cache.insert(chain(b), [4, 5, 6])
    clock.t = 2.0
    assert cache.recent_keys(3) == chain(b)
    assert cache.recent_keys(5) == chain(b) + A_KEYS[:2]  # a node cut by the bound keeps its first blocks
    clock.t = 3.0
    cache.match_prefix(A_KEYS)
    assert cache.recent_keys(4) == A_KEYS
    assert cache.recent_keys(100) == A_KEYS + chain(b)
