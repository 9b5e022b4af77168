"""Radix tree over full KV blocks: the prefix cache shared by every request.

Each edge holds a run of blocks; a key is the chained SHA-256 of a block and everything before
it (see `request.hash_block`), so equal keys mean equal prefixes, salt included. Children are
indexed by the key of their first block. Blocks are protected from eviction by the reference
counts the block manager keeps: `lock` takes one reference on every block from the root to a
node, `unlock` drops them. A node is evictable when it is a leaf, all its blocks are
unreferenced and its pin has expired; eviction takes least-recently-used leaves first.

    root ── [h0 h1 h2] ──┬── [h3 h4]        a request that matched h0..h4 holds refs on 5 blocks
                         └── [h3' ]         a sibling branch, evictable once nobody uses it

Its interface is the one every prefix cache has: `match_prefix`, `insert`, `lock` / `unlock`,
`evict`, `check_integrity` (and `pin`, for cache_control). A tier may sit under it (`LowerTier`, the
disk tier): it is given every block that enters the tree and told of every block that leaves it.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


@dataclass(eq=False)
class RadixNode:
    keys: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    tokens: list[tuple[int, ...]] = field(default_factory=list)  # each block's token ids (when kept)
    children: dict[bytes, "RadixNode"] = field(default_factory=dict)
    parent: "RadixNode | None" = None
    last_access: float = 0.0
    pin_until: float = 0.0

    @property
    def is_leaf(self) -> bool:
        return not self.children


class MatchResult(NamedTuple):
    node: RadixNode  # the deepest node covering exactly the matched blocks
    block_ids: list[int]
    partial_block: int = -1  # a cached block whose first `partial_tokens` slots hold the prompt's next tokens
    partial_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def num_tokens(self, block_size: int) -> int:
        """Prompt tokens the match serves: its full blocks, and the slots copied from a partial one."""
        return self.num_blocks * block_size + self.partial_tokens


class LowerTier(Protocol):
    """A tier under the pool's tree (`disk_tier.DiskTier`): what enters the tree is stored there too;
    what leaves it may still be read there."""

    def put(self, keys: list[bytes], blocks: list[int], first: bool = False) -> None:
        """These blocks entered the tree (first: a pinned prefix, stored before anything else)."""

    def evicting(self, keys: list[bytes], blocks: list[int]) -> None:
        """These blocks leave the tree; they may be handed out again from the next step on."""


class RadixCache:
    """The prefix tree. Reference counts live in the block manager and are shared here by reference."""

    def __init__(self, ref_counts: list[int], clock=time.monotonic):
        self.root = RadixNode()
        self.ref_counts = ref_counts
        self.clock = clock
        self.block_node: dict[int, RadixNode] = {}  # every cached block -> its node
        self.lower: LowerTier | None = None  # the tier under this one, if any

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_node)

    def contains_block(self, block_id: int) -> bool:
        return block_id in self.block_node

    def match_prefix(self, keys: list[bytes]) -> MatchResult:
        """Longest cached prefix of `keys`. Splits an edge matched part-way so the node is exact."""
        node, matched, now = self.root, [], self.clock()
        i = 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            n = _common_length(child.keys, keys[i:])
            if n < len(child.keys):
                child = self._split(child, n)
            child.last_access = now
            matched += child.blocks
            node, i = child, i + n
        return MatchResult(node, matched)

    def insert(self, keys: list[bytes], block_ids: list[int], tokens=None) -> int:
        """Insert a prefix. Blocks whose key is already cached are not taken (the caller keeps its copy).

        Args:
            tokens: a callable giving block i's token ids, kept for partial matches (`match_partial`).

        Returns:
            The number of leading keys that were already cached.
        """
        assert len(keys) == len(block_ids)
        node, i, now = self.root, 0, self.clock()
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                kept = [tuple(tokens(j)) if tokens else () for j in range(i, len(keys))]
                leaf = RadixNode(keys[i:], block_ids[i:], kept, parent=node, last_access=now)
                node.children[keys[i]] = leaf
                for b in leaf.blocks:
                    assert b not in self.block_node, f"block {b} cached twice"
                    self.block_node[b] = leaf
                if self.lower is not None:
                    self.lower.put(leaf.keys, leaf.blocks)
                return i
            n = _common_length(child.keys, keys[i:])
            if n < len(child.keys):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i

    def match_partial(self, node: RadixNode, block_tokens: list[int]) -> tuple[int, int]:
        """The cached block after `node` whose first slots hold the most of `block_tokens` (the
        prompt's next, not full, block): (block id, tokens in common), or (-1, 0)."""
        best, best_n = -1, 0
        for child in node.children.values():
            n = _common_length(child.tokens[0], block_tokens)  # () when its tokens were not kept
            if n > best_n:
                best, best_n = child.blocks[0], n
        if best_n:
            self.block_node[best].last_access = self.clock()
        return best, best_n

    def lock(self, node: RadixNode) -> None:
        """Take a reference on every block from the root down to `node`."""
        for b in _path_blocks(node):
            self.ref_counts[b] += 1

    def unlock(self, node: RadixNode) -> None:
        for b in _path_blocks(node):
            assert self.ref_counts[b] > 0, f"unlock of unreferenced block {b}"
            self.ref_counts[b] -= 1

    def pin(self, keys: list[bytes], ttl_s: float) -> int:
        """Keep the cached prefix of `keys` from eviction for ttl_s seconds. Returns the pinned block count."""
        match = self.match_prefix(keys)
        if match.num_blocks:
            match.node.pin_until = max(match.node.pin_until, self.clock() + ttl_s)
            if self.lower is not None:
                self.lower.put(keys[: match.num_blocks], match.block_ids, first=True)
        return match.num_blocks

    def is_evictable(self, node: RadixNode, now: float) -> bool:
        return (
            node is not self.root
            and node.is_leaf
            and node.pin_until <= now
            and all(self.ref_counts[b] == 0 for b in node.blocks)
        )

    def num_evictable_blocks(self) -> int:
        """Blocks that eviction could free now, counting parents freed after their children."""
        now = self.clock()
        total = 0
        stack = [self.root]
        order = []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        freeable: dict[int, bool] = {}
        for node in reversed(order):  # children before parents
            if node is self.root:
                continue
            ok = node.pin_until <= now and all(self.ref_counts[b] == 0 for b in node.blocks)
            ok = ok and all(freeable[id(c)] for c in node.children.values())
            freeable[id(node)] = ok
            if ok:
                total += len(node.blocks)
        return total

    def evict(self, num_blocks: int) -> list[int]:
        """Evict least-recently-used evictable leaves until num_blocks are freed or none is left.

        Returns:
            The freed block ids, in eviction order (a leaf's blocks tail first).
        """
        now = self.clock()
        heap = [(n.last_access, id(n), n) for n in self._leaves() if self.is_evictable(n, now)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_blocks:
            _, _, node = heapq.heappop(heap)
            if self.lower is not None:  # before the blocks can be handed out again
                self.lower.evicting(node.keys, node.blocks)
            freed += reversed(node.blocks)
            for b in node.blocks:
                del self.block_node[b]
            parent = node.parent
            del parent.children[node.keys[0]]
            if self.is_evictable(parent, now):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> list[int]:
        """Drop every unreferenced cached block. Returns the freed ids."""
        return self.evict(len(self.block_node) + 1)

    def check_integrity(self) -> None:
        """Every node's blocks are indexed, keys and blocks have equal length, children are keyed right."""
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert len(node.keys) == len(node.blocks)
            for b in node.blocks:
                assert self.block_node.get(b) is node, f"block {b} mis-indexed"
            seen += len(node.blocks)
            for key, child in node.children.items():
                assert child.parent is node and child.keys and child.keys[0] == key
                stack.append(child)
        assert seen == len(self.block_node), f"{seen} blocks in tree, {len(self.block_node)} indexed"

    def recent_keys(self, limit: int) -> list[bytes]:
        """Keys of up to `limit` cached blocks, most recently used first. A match touches every node on
        its path, so a node is never more recent than its parent: the keys returned are whole prefixes."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        nodes.sort(key=lambda n: -n.last_access)
        keys: list[bytes] = []
        for node in nodes:
            if len(keys) >= limit:
                break
            keys += node.keys[: limit - len(keys)]
        return keys

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.is_leaf and node is not self.root:
                yield node
            stack.extend(node.children.values())

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node's edge after n blocks; returns the new upper node."""
        upper = RadixNode(node.keys[:n], node.blocks[:n], node.tokens[:n], parent=node.parent,
                          last_access=node.last_access, pin_until=node.pin_until)
        node.parent.children[upper.keys[0]] = upper
        node.keys, node.blocks, node.tokens = node.keys[n:], node.blocks[n:], node.tokens[n:]
        node.parent = upper
        upper.children[node.keys[0]] = node
        for b in upper.blocks:
            self.block_node[b] = upper
        return upper


def _common_length(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _path_blocks(node: RadixNode):
    while node is not None:
        yield from node.blocks
        node = node.parent
