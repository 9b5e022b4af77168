"""Token counting under admission (`/v1/messages/count_tokens`, `/v1/responses/input_tokens`): the
tenant's budget is charged by the body's size before any tokenization, then settled at the tokens
counted, and the template and tokenizer run in a bounded number of worker threads, so a flood of large
bodies waits its turn (529 past a bounded queue) instead of taking every core."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request

from stratum.server.auth import tenant_of
from stratum.server.budget import CostAdmission, Reservation
from stratum.server.errors import Overloaded

# A body's bytes per token, for the charge made before counting: BPE vocabularies average about 4 bytes
# of English per token (OpenAI's rule of thumb); the charge is then settled at the exact count.
BYTES_PER_TOKEN = 4
MAX_WAITING = 64  # counts waiting for a worker before more get 529


class TokenCounter:
    """Admission and workers for the token-counting routes.

    Args:
        admission: the tenants' budgets (the generating routes' own).
        metrics: where refusals are counted.
        num_workers: counts run at once (default: half the cores, at least one).
    """

    def __init__(self, admission: CostAdmission, metrics, num_workers: int | None = None):
        self.admission = admission
        self.metrics = metrics
        self.num_workers = num_workers or max(1, (os.cpu_count() or 2) // 2)
        self._workers = asyncio.Semaphore(self.num_workers)
        self.num_waiting = 0

    @contextlib.asynccontextmanager
    async def admit(self, request: Request, endpoint: str, num_body_bytes: int) -> AsyncIterator[Counting]:
        """Reserve the body's estimated tokens against the tenant's budget and wait for a worker; the
        block counts with `Counting.count`, and leaving it settles the reservation at what was counted
        (nothing, when it failed).

        Raises:
            RateLimited: 429, the estimate does not fit in what the tenant has left.
            Overloaded: 529, MAX_WAITING counts already wait for a worker.
        """
        counting = Counting(Reservation(self.admission, tenant_of(request, None), endpoint, self.metrics))
        counting.reservation.reserve(num_body_bytes // BYTES_PER_TOKEN + 1, 0, "counting this body's tokens")
        try:
            if self.num_waiting >= MAX_WAITING and self._workers.locked():
                self.metrics.rejections.labels("queue_full").inc()
                raise Overloaded(f"{MAX_WAITING} token counts are waiting; retry shortly", headers={"retry-after": "1"})
            self.num_waiting += 1
            try:
                await self._workers.acquire()
            finally:
                self.num_waiting -= 1
            try:
                yield counting
            finally:
                self._workers.release()
        finally:
            counting.reservation.settle(counting.usage)


@dataclass(slots=True)
class Counting:
    """One admitted count: its reservation, and what it counted once it has."""

    reservation: Reservation
    usage: dict[str, int] | None = None

    async def count(self, fn: Callable[..., Any], *args) -> Any:
        """`fn(*args)` (a prompt build) in a worker thread; its `token_ids` are what the count is charged."""
        prompt = await asyncio.to_thread(fn, *args)
        self.usage = {"input_tokens": len(prompt.token_ids), "cache_creation_input_tokens": 0, "output_tokens": 0}
        return prompt
