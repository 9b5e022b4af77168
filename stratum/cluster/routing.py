"""Which replica serves a request: the routing policies, as plain objects (no Ray here).

A request arrives with the short keys of its prompt's full blocks (`request.prompt_block_keys`: the
salted SHA-256 chain the replicas' prefix caches are keyed by). Because each key chains every block
before it, a replica holds the first k blocks of the prompt exactly when it holds key k-1, so the
matched length is found from one lookup per block, from the longest prefix down.

A policy knows two things about each replica: what the replica last reported (its load, its free KV
blocks, the keys of its most recently used cached blocks), and what this router did since — the
requests it sent that have not completed, and the prefixes it placed there. A placement stands in for
the replica's own word until a report made well after it arrives: by then the replica either holds
that prefix or has evicted it, and its report says which.

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
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class ReplicaState:
    """One replica, as the router sees it."""

    name: str
    in_flight: int = 0  # requests this router sent it that have not completed
    reported_load: int = 0  # running + waiting requests, from its last report
    reported_free_blocks: int | None = None  # KV blocks neither cached nor in use, from its last report
    held: frozenset[int] = frozenset()  # short keys of the cached blocks it last reported
    reported_at: float = 0.0  # when it made that report (its clock)
    placed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # keys sent here since -> when

    @property
    def load(self) -> int:
        return max(self.in_flight, self.reported_load)

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
        placement_grace_s: a placement is forgotten once the replica reports this long after it.
        max_placed: placements remembered per replica (oldest forgotten first).
        clock: wall-clock seconds, comparable with the replicas' report times.
    """

    def __init__(self, placement_grace_s: float = 2.0, max_placed: int = 8192, clock=time.time):
        self.replicas: dict[str, ReplicaState] = {}
        self.placement_grace_s = placement_grace_s
        self.max_placed = max_placed
        self.clock = clock

    def set_replicas(self, names: list[str]) -> None:
        """The replicas that exist now: new ones start empty, gone ones are forgotten."""
        self.replicas = {n: self.replicas.get(n) or ReplicaState(n) for n in names}

    def report(self, name: str, at: float, load: int, free_blocks: int | None, held: list[int]) -> None:
        """A replica's own account (routing stats); an older or repeated report changes nothing."""
        state = self.replicas.get(name)
        if state is None or at <= state.reported_at:
            return
        state.reported_at, state.reported_load, state.reported_free_blocks = at, load, free_blocks
        state.held = frozenset(held)
        while state.placed and next(iter(state.placed.values())) <= at - self.placement_grace_s:
            state.placed.popitem(last=False)

    def routed(self, name: str, keys: list[int]) -> None:
        state = self.replicas.get(name)
        if state is not None:
            state.in_flight += 1
            self._place(state, keys)

    def _place(self, state: ReplicaState, keys: list[int]) -> None:
        now = self.clock()
        for key in keys:
            if key not in state.held:
                state.placed[key] = now
                state.placed.move_to_end(key)
        while len(state.placed) > self.max_placed:
            state.placed.popitem(last=False)

    def completed(self, name: str) -> None:
        state = self.replicas.get(name)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def rank(self, keys: list[int], candidates: list[str]) -> list[str]:
        """The candidates in the order to try them, best first."""
        raise NotImplementedError

    def _states(self, candidates: list[str]) -> list[ReplicaState]:
        return [self.replicas.get(n) or ReplicaState(n) for n in candidates]


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
            return [best.name] + [s.name for s in sorted(near, key=lambda s: s.load) if s is not best] + [s.name for s in far]
        # A new prefix: where the most KV memory is free, so the replicas share the hot prefixes evenly.
        # It is placed now, not once routed: Serve routes requests concurrently, and the next request
        # with this prefix may be ranked before this one is sent.
        near.sort(key=lambda s: (-s.free_blocks, s.load, spread[s.name]))
        if keys and near[0].name in self.replicas:
            self._place(self.replicas[near[0].name], keys)
        return [s.name for s in near] + [s.name for s in far]


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
