"""The engine process brought back after it dies: `Supervisor` decides whether and when a new one starts
(bounded backoff; a crash loop, more deaths within a window than `RestartPolicy` allows, is given up),
and says where it stands (`Supervision`, for /health and /metrics). `engine/process.py:EngineProcess`
does the starting. Only the engine's own process is supervised: Ray Serve restarts its replicas itself.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("stratum.engine")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Args:
        max_restarts: restarts allowed within window_s; the death after the last of them is a crash
            loop, and the engine stays dead. 0: an engine that dies is never started again.
        window_s: how far back deaths count towards a crash loop.
        backoff_s: the wait before the restart after a first death; doubled for each further death in
            the window, up to max_backoff_s.
    """

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def backoff(self, num_recent_deaths: int) -> float:
        """The wait before restarting after the num_recent_deaths-th death within the window."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, num_recent_deaths - 1))


@dataclass(frozen=True, slots=True)
class Supervision:
    """Where the supervisor stands, as /health and /metrics say it."""

    state: str  # "running" | "restarting" | "given_up"
    num_restarts: int  # engine processes started again after a death, since the server started
    last_death: str | None  # why the engine last died
    last_restart_s: float | None  # from the last death to the new engine's readiness
    retry_after_s: int  # while restarting: seconds until the engine is likely back


class Supervisor:
    """The restart decisions of one engine process's successive lives. Thread-safe.

    Args:
        policy: how often, and after how long, a dead engine is started again.
        start_s: how long a start takes (the first one's measured time), until a restart measures its own.
    """

    def __init__(self, policy: RestartPolicy, start_s: float = 5.0, clock=time.monotonic):
        self.policy = policy
        self.clock = clock
        self._deaths: deque[float] = deque()
        self._lock = threading.Lock()
        self._state = "running"
        self._num_restarts = 0
        self._last_death: str | None = None
        self._died_at = 0.0
        self._next_start_at = 0.0
        self._start_s = start_s
        self._last_restart_s: float | None = None
        self.given_up: str | None = None  # the crash loop's report, once given up

    def started(self, start_s: float) -> None:
        """The first engine is ready; its start took start_s."""
        with self._lock:
            self._start_s = start_s

    def died(self, reason: str) -> float | None:
        """The engine died (or a restart failed to start) for `reason`.

        Returns:
            the wait before starting the next one; None when this death makes a crash loop (or restarts
            are off): the engine stays dead, and `given_up` says why.
        """
        p = self.policy
        with self._lock:
            now = self.clock()
            if self._state != "restarting":
                self._died_at = now
            self._last_death = reason
            self._deaths.append(now)
            while self._deaths and self._deaths[0] < now - p.window_s:
                self._deaths.popleft()
            n = len(self._deaths)
            if n > p.max_restarts:
                self._state = "given_up"
                self.given_up = (f"the engine process died {n} times within {p.window_s:g}s and is not started "
                                 f"again (--engine-restarts {p.max_restarts}); last: {reason}"
                                 if p.max_restarts else f"the engine process died ({reason}); restarts are off")
                log.error("%s", self.given_up)
                return None
            self._state = "restarting"
            delay = p.backoff(n)
            self._next_start_at = now + delay
        log.warning("engine process died: %s; starting a new one in %.1fs (death %d of %d allowed within %gs)",
                    reason, delay, n, p.max_restarts, p.window_s)
        return delay

    def restarted(self, pid: int) -> float:
        """A new engine is ready. Returns the time from the death to now."""
        with self._lock:
            took = self.clock() - self._died_at
            self._state, self._last_restart_s = "running", took
            self._num_restarts += 1
            self._start_s = max(0.0, took - (self._next_start_at - self._died_at))
            n = self._num_restarts
        log.warning("engine process restarted in %.2fs after its death: pid %d, restart %d", took, pid, n)
        return took

    @property
    def is_restarting(self) -> bool:
        return self._state == "restarting"

    def view(self) -> Supervision:
        with self._lock:
            retry = 0
            if self._state == "restarting":
                retry = max(1, math.ceil(self._next_start_at - self.clock() + self._start_s))
            return Supervision(self._state, self._num_restarts, self._last_death, self._last_restart_s, retry)
