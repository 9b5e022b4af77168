"""What a step costs: a model of step time learnt online from the steps the engine runs, and the
largest prefill chunk that keeps a step inside a time budget (the scheduler's `--max-itl-ms`).

A step's seconds are fitted as a linear function of what it computes (`step_features`):

    step_s ~ c0 + c1 * rows + c2 * attention_pairs / 1000

rows: every token row the model runs (decodes, verified proposals, prefill chunks; a request's
sampling is in its row's cost); attention_pairs: the (query, key) pairs of causal attention, which
grow with the context. (A term per request made the fit unstable: in decode steps it moves with the
rows, and the first steps' noise went to it.) The fit is a least-squares regression with older steps weighed down
(DECAY per step), so that it follows the load of the machine; it starts from a conservative guess
(`StepCost.prior`) held as pseudo-steps that fade faster than measured ones, with a faint ridge
toward it left so that an axis no step has exercised keeps the guess. Plain Python: the scheduler never touches tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY = 0.97  # weight of a step one step older: the fit follows the last ~30 steps
PRIOR_WEIGHT = 2.0  # the prior counts as two steps' evidence at first...
PRIOR_DECAY = 0.9  # ...and fades faster than they do: after ~30 steps the fit is the measured steps'
FLOOR_WEIGHT = 0.02  # what stays of it, as a ridge toward the prior scaled by the measured speed
_PAIRS_SCALE = 1e-3  # attention pairs per unit of the c3 feature (keeps the normal equations conditioned)
NUM_FEATURES = 3


def step_features(num_rows: int, num_attention_pairs: float) -> tuple[float, ...]:
    return (1.0, float(num_rows), num_attention_pairs * _PAIRS_SCALE)


def chunk_pairs(start: int, num_tokens: int) -> float:
    """(query, key) pairs of a chunk of num_tokens rows after start computed positions: each row attends
    to every position before it and to itself."""
    return num_tokens * start + num_tokens * (num_tokens + 1) / 2


@dataclass(frozen=True, slots=True)
class CostPrior:
    """A conservative first guess of a step's cost, before any step was measured.

    fixed_s: a step's own cost; row_s: one token row through the model; pair_s: one thousand
    attention pairs."""

    fixed_s: float
    row_s: float
    pair_s: float

    @classmethod
    def guess(cls, num_parameters: int, hidden_size: int, num_layers: int, device: str) -> "CostPrior":
        """FLOPs at a rate below the device's: two per parameter and row, four per hidden unit, layer
        and attention pair (QK^T and PV), the latter at half the rate (attention is the less efficient
        kernel); 50 GFLOP/s for a CPU (SmolLM2-135M prefills at about 250 tokens/s, 67 GFLOP/s, on
        two cores: docs/benchmarks.md), 10 TFLOP/s for a GPU. A step's own cost: two rows'."""
        flops = 5e10 if device == "cpu" else 1e13
        row_s = 2.0 * max(1, num_parameters) / flops
        pair_s = 1000 * 4.0 * hidden_size * num_layers / (flops / 2)
        return cls(fixed_s=2.0 * row_s, row_s=row_s, pair_s=pair_s)


class StepCost:
    """The fitted cost of a step (least squares with forgetting over the measured steps).

    Where the steps leave a direction undetermined (decode steps alone: rows and attention pairs
    grow together), the fit keeps the prior's shape scaled by the machine's measured speed: a
    faint ridge toward `prior` times the running ratio of measured to guessed step times.

    Args:
        prior: the cost assumed before any measurement; the fit starts there and leaves it as steps
            are measured.
    """

    def __init__(self, prior: CostPrior):
        self.prior = prior
        self._prior = [prior.fixed_s, prior.row_s, prior.pair_s]
        # the prior's weight per axis, scaled so that every axis weighs alike (a step of 256 rows,
        # 64k attention pairs)
        scale = (1.0, 256.0, 64.0)
        n = NUM_FEATURES
        self._gram = [[0.0] * n for _ in range(n)]
        self._moment = [0.0] * n
        self._scale2 = [s * s for s in scale]
        self._prior_weight = PRIOR_WEIGHT
        self._log_speed = 0.0  # log(measured / guessed), averaged with the steps' decay
        self.coefficients = list(self._prior)
        self.num_observed = 0

    def predict(self, features: tuple[float, ...]) -> float:
        """Seconds a step with these features takes, by the current fit."""
        return sum(c * x for c, x in zip(self.coefficients, features))

    def observe(self, features: tuple[float, ...], step_s: float) -> None:
        """Add one measured step and refit (a 3 x 3 solve: microseconds)."""
        if not math.isfinite(step_s) or step_s <= 0:
            return
        n = NUM_FEATURES
        for i in range(n):
            self._moment[i] = DECAY * self._moment[i] + features[i] * step_s
            row = self._gram[i]
            for j in range(n):
                row[j] = DECAY * row[j] + features[i] * features[j]
        guessed = sum(c * x for c, x in zip(self._prior, features))
        if guessed > 0:
            self._log_speed = DECAY * self._log_speed + (1 - DECAY) * math.log(step_s / guessed)
        self._prior_weight *= PRIOR_DECAY
        self.num_observed += 1
        self.coefficients = self._solve()

    def _solve(self) -> list[float]:
        """argmin sum w (x.c - y)^2 + sum ridge_i (c_i - prior_i)^2 over the steps and pseudo-steps,
        each c_i then kept >= 0."""
        n = NUM_FEATURES
        ridge = [(self._prior_weight + FLOOR_WEIGHT) * s2 for s2 in self._scale2]
        # the speed's average is biased toward 1 by its start at 0: divide by the weight it has
        speed = math.exp(self._log_speed / (1 - DECAY ** self.num_observed))
        target = [p * speed for p in self._prior]
        a = [[self._gram[i][j] + (ridge[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [self._moment[i] + ridge[i] * target[i] for i in range(n)]
        for col in range(n):  # Gaussian elimination with partial pivoting
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            b[col], b[pivot] = b[pivot], b[col]
            for r in range(col + 1, n):
                f = a[r][col] / a[col][col]
                for k in range(col, n):
                    a[r][k] -= f * a[col][k]
                b[r] -= f * b[col]
        c = [0.0] * n
        for r in range(n - 1, -1, -1):
            c[r] = (b[r] - sum(a[r][k] * c[k] for k in range(r + 1, n))) / a[r][r]
        return [max(0.0, v) for v in c]

    def added_s(self, start: int, num_tokens: int) -> float:
        """What num_tokens rows after start computed positions add to a step."""
        c = self.coefficients
        return c[1] * num_tokens + c[2] * chunk_pairs(start, num_tokens) * _PAIRS_SCALE

    def chunk_for(self, budget_s: float, start: int) -> int:
        """The most prefill tokens, after start computed positions, whose added cost fits budget_s
        (0 when not even one does). The cost of n rows is quadratic in n through attention."""
        _, c1, c2 = self.coefficients
        room = budget_s
        if room <= 0:
            return 0
        # added_s(n) = c1 n + c2 * 1e-3 * (n start + n (n + 1) / 2)
        qa = c2 * _PAIRS_SCALE / 2
        qb = c1 + c2 * _PAIRS_SCALE * (start + 0.5)
        if qa <= 0:
            return int(room / qb) if qb > 0 else 1 << 30
        return int((-qb + math.sqrt(qb * qb + 4 * qa * room)) / (2 * qa))

    def describe(self) -> dict[str, float | int]:
        c0, c1, c2 = self.coefficients
        return {"fixed_ms": round(c0 * 1e3, 3), "row_ms": round(c1 * 1e3, 4), "per_1k_pairs_ms": round(c2 * 1e3, 5),
                "steps_observed": self.num_observed}
