"""Which replica serves a request: the routing policies, as plain objects (no Ray here).

A request arrives with the short keys of its prompt's full blocks (`request.prompt_block_keys`: the
salted SHA-256 chain the replicas' prefix caches are keyed by). Because each key chains every block
before it, a replica holds the first k blocks of the prompt exactly when it holds key k-1, so the
matched length is found from one lookup per block, from the longest prefix down.

A policy knows two things about each replica: what the replica last reported (the requests it
serves, its free KV blocks, the keys of its most recently used cached blocks, whether its engine
runs), and what this router did since — the requests it sent, and the prefixes it placed there. A
placement stands in for the replica's own word until a cache listing made well after it arrives: by
then the replica either holds that prefix or has evicted it, and its listing says which.

    PrefixPolicy       the longest cached match, unless it covers too little of the prompt or that
                       replica's queue is too long; a new prefix goes to the replica with the most
                       free KV blocks among those whose queues are short enough, and is remembered
    RoundRobinPolicy   each replica in turn (the cache-blind baseline)
    PowerOfTwoPolicy   the less loaded of two replicas drawn at random (Ray Serve's default idea)
"""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class ReplicaState:
    """One replica, as the router sees it."""

    name: str
    alive: bool = True  # its engine loop runs, as it last reported
    reported_load: int = 0  # requests it was serving when it last reported
    routed_since: deque[float] = field(default_factory=deque)  # when this router sent it requests since then
    reported_free_blocks: int | None = None  # KV blocks neither cached nor in use, from its last report
    held: frozenset[int] = frozenset()  # short keys of the cached blocks it last reported
    held_at: float = 0.0  # when its engine listed them (its clock)
    reported_at: float = 0.0  # when it made its last report
    placed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # keys sent here since -> when

    @property
    def load(self) -> int:
        """Requests it serves: its own count at its last report, and what was sent to it since.
        (Completions are not counted down here; the next report, within a period, does that.)"""
        return self.reported_load + len(self.routed_since)

    @property
    def free_blocks(self) -> float:
        """Free KV blocks, less what the prefixes placed since the last report will take."""
        if self.reported_free_blocks is None:
            return float("inf")
        return self.reported_free_blocks - len(self.placed)

    def matched_blocks(self, keys: list[int]) -> int:
        """How many leading blocks of the prompt this replica holds, or will once its placements run."""
        for i in range(len(keys) - 1, -1, -1):
            if keys[i] in self.held or keys[i] in self.placed:
                return i + 1
        return 0


class Policy:
    """The bookkeeping every policy shares; subclasses order the replicas (`rank`).

    Args:
        placement_grace_s: a placement is forgotten once the replica's cache listing is this much
            newer: time for the request to wait, prefill and write its blocks to the cache.
        max_placed: placements remembered per replica (oldest forgotten first).
        clock: wall-clock seconds, comparable with the replicas' report times.
    """

    def __init__(self, placement_grace_s: float = 10.0, max_placed: int = 8192, clock=time.time):
        self.replicas: dict[str, ReplicaState] = {}
        self.placement_grace_s = placement_grace_s
        self.max_placed = max_placed
        self.clock = clock

    def set_replicas(self, names: list[str]) -> None:
        """The replicas that exist now: new ones start empty, gone ones are forgotten."""
        self.replicas = {n: self.replicas.get(n) or ReplicaState(n) for n in names}

    def report(self, name: str, at: float, load: int, free_blocks: int | None, held: list[int],
               held_at: float | None = None, alive: bool = True) -> None:
        """A replica's own account (routing stats) made at `at`, its cache listed at `held_at`; an
        older or repeated report changes nothing."""
        state = self.replicas.get(name)
        if state is None or at <= state.reported_at:
            return
        state.reported_at, state.reported_load, state.reported_free_blocks, state.alive = at, load, free_blocks, alive
        while state.routed_since and state.routed_since[0] <= at:
            state.routed_since.popleft()
        held_at = at if held_at is None else held_at
        if held_at >= state.held_at:
            state.held, state.held_at = frozenset(held), held_at
            while state.placed and next(iter(state.placed.values())) <= held_at - self.placement_grace_s:
                state.placed.popitem(last=False)

    def routed(self, name: str, keys: list[int]) -> None:
        state = self.replicas.get(name)
        if state is not None:
            state.routed_since.append(self.clock())
            self._place(state, keys)

    def _place(self, state: ReplicaState, keys: list[int]) -> None:
        now = self.clock()
        for key in keys:
            if key not in state.held:
                state.placed[key] = now
                state.placed.move_to_end(key)
        while len(state.placed) > self.max_placed:
            state.placed.popitem(last=False)

    def rank(self, keys: list[int], candidates: list[str]) -> list[str]:
        """The candidates in the order to try them, best first."""
        raise NotImplementedError

    def _states(self, candidates: list[str]) -> list[ReplicaState]:
        """The candidates' states; a replica that reported its engine dead is left out while any other
        remains (Serve replaces it within seconds)."""
        states = [self.replicas.get(n) or ReplicaState(n) for n in candidates]
        return [s for s in states if s.alive] or states


class PrefixPolicy(Policy):
    """Follow the prefix cache.

    Args:
        max_imbalance: how many more requests than the least-loaded candidate the replica holding the
            longest match may have before the request goes elsewhere (it then computes the prefix again).
        min_match_ratio: the share of the prompt's blocks a match must cover to decide; below it (a
            chat template's opening, say) the request is placed as a new prefix. SGLang's router makes
            the same cut (its `cache_threshold`, 0.5 by default).
    """

    def __init__(self, max_imbalance: int = 8, min_match_ratio: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.max_imbalance = max_imbalance
        self.min_match_ratio = min_match_ratio
        self._turn = itertools.count()  # breaks exact ties, so equal replicas share new prefixes

    def rank(self, keys: list[int], candidates: list[str]) -> list[str]:
        if not candidates:
            return []
        states = self._states(candidates)
        turn = next(self._turn)
        spread = {s.name: (i - turn) % len(states) for i, s in enumerate(states)}
        least = min(s.load for s in states)
        near = [s for s in states if s.load - least <= self.max_imbalance]  # queues short enough to join
        far = sorted((s for s in states if s.load - least > self.max_imbalance), key=lambda s: s.load)
        matches = {s.name: s.matched_blocks(keys) for s in near}
        best = max(near, key=lambda s: (matches[s.name], -s.load, -spread[s.name]))
        if matches[best.name] > 0 and matches[best.name] >= self.min_match_ratio * len(keys):
            return ([best.name] + [s.name for s in sorted(near, key=lambda s: s.load) if s is not best]
                    + [s.name for s in far])
        if not keys:  # nothing to cache (a prompt under one block): the shortest queue
            near.sort(key=lambda s: (s.load, spread[s.name]))
            return [s.name for s in near] + [s.name for s in far]
        # A new prefix: where KV memory for the most prefixes of its size is free, so the replicas
        # share the hot prefixes evenly (a block or two of difference does not outweigh the queue).
        # It is placed now, not once routed: Serve routes requests concurrently, and the next request
        # with this prefix may be ranked before this one is sent.
        near.sort(key=lambda s: (-_room(s, len(keys)), s.load, spread[s.name]))
        if near[0].name in self.replicas:
            self._place(self.replicas[near[0].name], keys)
        return [s.name for s in near] + [s.name for s in far]


def _room(state: ReplicaState, num_blocks: int) -> float:
    """How many prefixes of num_blocks its free KV blocks still hold (unbounded before any report)."""
    free = state.free_blocks
    return free if free == float("inf") else free // num_blocks


class RoundRobinPolicy(Policy):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._turn = itertools.count()

    def rank(self, keys: list[int], candidates: list[str]) -> list[str]:
        if not candidates:
            return []
        start = next(self._turn) % len(candidates)
        return candidates[start:] + candidates[:start]


class PowerOfTwoPolicy(Policy):
    def __init__(self, seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self._random = random.Random(seed)

    def rank(self, keys: list[int], candidates: list[str]) -> list[str]:
        two = self._random.sample(candidates, min(2, len(candidates)))
        two.sort(key=lambda n: (self.replicas.get(n) or ReplicaState(n)).load)
        return two + [n for n in candidates if n not in two]


POLICIES = {"prefix": PrefixPolicy, "round-robin": RoundRobinPolicy, "power-of-two": PowerOfTwoPolicy}


def make_policy(name: str, **kwargs) -> Policy:
    try:
        return POLICIES[name](**kwargs)
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (one of {', '.join(POLICIES)})") from None
