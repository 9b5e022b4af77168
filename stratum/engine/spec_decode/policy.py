"""When speculation pays: how many proposed tokens each decoding request verifies in the coming step.

More rows make the step longer; they pay when the tokens they are expected to add raise the step's
tokens per second. Both sides are measured: the step's time by its rows from the kernel plan's
timings of the native step's kernels at each batch size, plus the residual of recent steps (what the
plan's kernels leave out: weights streamed from memory rather than cache, attention, the work
around the forward); and each request's acceptance from what was accepted so far. Where rows are
nearly free (one stream, a memory-bound step) long proposals pay; where the step is compute-bound
(a large batch) the extra rows cost what they would yield and speculation turns itself off.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np

# Prompt lookup's proposals by how long a match they came from: bucket i holds match lengths from
# BUCKET_BOUNDS[i] up to the next bound (a long match is a copy, a short one often a common phrase).
BUCKET_BOUNDS = (1, 2, 3, 4, 8, 16)
DRAFT_BUCKET = len(BUCKET_BOUNDS)  # the draft model's proposals
PRIOR = (1.0, 1.0)  # pseudo-counts of accepted and rejected proposals per bucket before any is measured
REQUEST_WEIGHT = 2.0  # how many of its own verifications the bucket's rate counts for in a request's
OBSERVED_STEPS = 64  # recent decode steps the cost fit reads
FIT_EVERY = 8  # steps between fits
MIN_SLOPES = 16  # pairs of steps with different rows before the fit's scale is taken
MIN_SCALE, MAX_SCALE = 0.25, 8.0  # the plan's kernels against the real step: a fit beyond is noise


def bucket_of(match_length: int) -> int:
    return max(i for i, bound in enumerate(BUCKET_BOUNDS) if match_length >= bound)


class Acceptance:
    """The conditional acceptance rate of proposed tokens: of the proposals verified while every one
    before them was accepted, the share accepted. A verify step of k proposals that kept a counts
    a acceptances and, when a < k, one rejection (the tokens after a rejection are never judged)."""

    def __init__(self):
        self.accepted = [PRIOR[0]] * (DRAFT_BUCKET + 1)
        self.rejected = [PRIOR[1]] * (DRAFT_BUCKET + 1)

    def rate(self, bucket: int, num_accepted: int = 0, num_rejected: int = 0) -> float:
        """The bucket's rate, moved toward a request's own record (its accepted and rejected counts)."""
        base = self.accepted[bucket] / (self.accepted[bucket] + self.rejected[bucket])
        return (num_accepted + REQUEST_WEIGHT * base) / (num_accepted + num_rejected + REQUEST_WEIGHT)

    def record(self, bucket: int, num_accepted: int, num_proposed: int) -> None:
        self.accepted[bucket] += num_accepted
        self.rejected[bucket] += num_accepted < num_proposed


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise linear through (rows, seconds), extended past the last point along the last segment."""
    if not points or x <= 0:
        return 0.0
    if x <= points[0][0]:
        return points[0][1] * x / points[0][0]
    for (a, ta), (b, tb) in zip(points, points[1:]):
        if x <= b:
            return ta + (tb - ta) * (x - a) / (b - a)
    (a, ta), (b, tb) = points[-2:] if len(points) > 1 else ((0, 0.0), points[-1])
    return tb + (tb - ta) * (x - b) / (b - a)


def _rising(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """A kernel's timings by rows, or none where more rows took less time (a plan measured while other
    processes held the cores: its figures say nothing of the shape)."""
    return points if all(ta <= tb for (_, ta), (_, tb) in zip(points, points[1:])) else []


class StepCost:
    """A target step's seconds by its rows (tokens computed) and logit rows.

    The kernel plan times the native step's kernels on weights that stay in cache, so it gives the
    shape of the cost, P(rows), but neither its scale on a busy machine nor what a step adds on top
    (weights streamed from memory, attention, the work around the forward). Recent decode steps'
    measured times t fit t = scale * P(rows) + base, by Theil-Sen (the median of the pairwise slopes,
    robust to steps another process slowed): the step's rows vary as speculation does, which is what
    makes the fit possible. Until they do, scale is 1 and base the median residual.

    Args:
        timings: the kernel plan's `timings_us` where its measurement was quiet: a decoder layer's
            projections on the native kernel by rows ("packed", or "native_<threads>_threads" at the
            engine's threads), and the output projection by rows ("head_packed") where it was timed.
            A plan that timed nothing leaves the fit to find the cost of a row from the steps alone.
        num_layers: the model's decoder layers.
        threads: the engine's threads.
    """

    def __init__(self, timings: dict, num_layers: int, threads: int = 0):
        self.num_layers = num_layers
        layer = timings.get("packed") or timings.get(f"native_{threads}_threads") or {}
        self.layer = _rising(sorted((int(m), us * 1e-6) for m, us in layer.items()))
        self.head = _rising(sorted((int(m), us * 1e-6) for m, us in (timings.get("head_packed") or {}).items()))
        # nothing timed (or nothing believable): P(rows) = rows, and the fit finds a row's seconds, free
        # until measured (the proposals made meanwhile vary the rows, which the fit needs)
        self.is_shaped = bool(self.layer)
        if not self.is_shaped:
            self.layer, self.num_layers, self.head = [(1, 1.0)], 1, []
        self.observed: deque[tuple[float, float]] = deque(maxlen=OBSERVED_STEPS)  # (P(rows), seconds)
        self.scale, self.base = (1.0 if self.is_shaped else 0.0), 0.0
        self._since_fit = 0

    def plan_s(self, rows: int, logit_rows: int) -> float:
        return self.num_layers * _interpolate(self.layer, rows) + _interpolate(self.head, logit_rows)

    def observe(self, rows: int, logit_rows: int, step_s: float) -> None:
        """A decode step (no prefill in it) took step_s."""
        self.observed.append((self.plan_s(rows, logit_rows), step_s))
        self._since_fit += 1
        if self._since_fit >= FIT_EVERY or len(self.observed) <= FIT_EVERY:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        p, t = np.array(self.observed).T
        if p.max() - p.min() > 0.05 * p.max():  # else no pair differs enough (one stream, nothing proposed)
            # every pair of steps, the later one with enough more planned time (~0.5 ms a fit of 64
            # steps as a Python loop over the 2,016 pairs, every 8th step)
            dp, dt = p[None, :] - p[:, None], t[None, :] - t[:, None]
            later = np.triu(np.ones((len(p), len(p)), dtype=bool), 1) & (dp > 0.05 * np.maximum(p[None, :], p[:, None]))
            slopes = dt[later] / dp[later]
        else:
            slopes = p[:0]
        if self.is_shaped:
            scale = float(np.median(slopes)) if len(slopes) >= MIN_SLOPES else 1.0
            self.scale = min(max(scale, MIN_SCALE), MAX_SCALE)
        elif len(slopes) >= MIN_SLOPES:  # seconds per row, measured
            self.scale = max(0.0, float(np.median(slopes)))
        self.base = max(0.0, float(np.median(t - self.scale * p)))

    def time(self, rows: int, logit_rows: int) -> float:
        return self.scale * self.plan_s(rows, logit_rows) + self.base


def choose(cost: StepCost, candidates: list[tuple[float, int]], num_decodes: int, rows: int,
           level_s: float = 0.0) -> list[int]:
    """How many proposed tokens each candidate verifies: rows are added one at a time, the most
    likely accepted first (a request's j-th proposal is accepted with probability rate^j), while
    each raises the step's expected tokens per second.

    Args:
        candidates: per decoding request that has proposals, (its acceptance rate, most tokens).
        num_decodes: decoding requests in the step (each yields a token without speculation).
        rows: the step's rows without proposals (decodes and prefill chunks).
        level_s: the seconds one more draft-model forward takes (0 for prompt lookup): paid once
            per proposal depth, for every request drafting that deep.
    Returns:
        Tokens to propose, per candidate.
    """
    ks = [0] * len(candidates)
    tokens, logit_rows, depth = float(num_decodes), num_decodes, 0
    t = cost.time(rows, logit_rows)
    heap = [(-rate, i) for i, (rate, most) in enumerate(candidates) if most > 0 and rate > 0]
    heapq.heapify(heap)
    while heap:
        gain, i = heapq.heappop(heap)
        gain = -gain
        t_new = cost.time(rows + 1, logit_rows + 1) + level_s * max(depth, ks[i] + 1)
        if t_new > t and (tokens + gain) * t <= tokens * t_new:  # a row that costs nothing always pays
            break
        ks[i] += 1
        depth = max(depth, ks[i])
        tokens, rows, logit_rows, t = tokens + gain, rows + 1, logit_rows + 1, t_new
        rate, most = candidates[i]
        if ks[i] < most:
            heapq.heappush(heap, (-(rate ** (ks[i] + 1)), i))
    return ks
