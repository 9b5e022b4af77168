"""The native step's threads at run time: as many as the cores other processes leave free, at most
the plan's; each parallel section ends in a barrier, so a thread the OS descheduled stalls the step."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
INTERVAL_S = 0.25  # between samples: /proc/stat is read at most this often, whatever the step rate
# hysteresis in cores: a thread is added once the free cores reach it less RAISE_MARGIN, and dropped
# once they fall DROP_MARGIN below the threads in use, so a load hovering at a boundary does not flap
RAISE_MARGIN = 0.25
DROP_MARGIN = 0.75
# a window longer than this, in which this process was busy on under half a core, spans an idle
# engine: the load it saw is what other processes did then (a benchmark's peer serving its turn), not
# now, and the first steps after it ran on one thread for it (measured: a 1 B prompt's first token
# ~1.5x later right after another server's round)
IDLE_WINDOW_S = 1.0


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Cumulative CPU time: the machine's busy and total jiffies (/proc/stat's `cpu` line), its cores,
    and this process's own CPU seconds (os.times)."""

    busy: int
    total: int
    cores: int
    own_s: float


def parse_stat(text: str, own_s: float) -> CpuSample:
    """A sample from /proc/stat's text. Idle and iowait are free time; steal (a hypervisor's other
    guests) counts as busy, since a thread on a stolen core waits just the same."""
    fields = [int(v) for v in text.split("\n", 1)[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    cores = sum(1 for line in text.splitlines() if line.startswith("cpu") and line[3:4].isdigit())
    total = sum(fields)
    return CpuSample(busy=total - fields[3] - fields[4], total=total, cores=max(1, cores), own_s=own_s)


def other_busy_cores(before: CpuSample, after: CpuSample, clock_ticks: int) -> float:
    """The cores other processes kept busy between two samples: the machine's busy share of its
    cores, less this process's own CPU time (its threads' spin-waits included)."""
    total = after.total - before.total
    if total <= 0:
        return 0.0
    busy = (after.busy - before.busy) / total * after.cores
    own = (after.own_s - before.own_s) * clock_ticks / total * after.cores
    return max(0.0, busy - own)


def spans_idle(before: CpuSample, after: CpuSample, clock_ticks: int) -> bool:
    """Whether the window between two samples is mostly an idle engine's (IDLE_WINDOW_S)."""
    seconds = (after.total - before.total) / clock_ticks / after.cores
    return seconds > IDLE_WINDOW_S and after.own_s - before.own_s < 0.5 * seconds


def next_threads(current: int, limit: int, cores: int, other: float) -> int:
    """The threads to use next: the free cores (`cores - other`), rounded with hysteresis around
    `current`, within [1, limit]."""
    free = cores - other
    lower = math.floor(free + DROP_MARGIN)  # the most threads kept without dropping
    upper = math.floor(free + RAISE_MARGIN)  # the most threads the free cores justify adding up to
    if current > lower:
        wanted = lower
    elif current < upper:
        wanted = upper
    else:
        wanted = current
    return max(1, min(limit, wanted))


class ThreadGovernor:
    """Follows the machine's load: `threads(limit)` says how many threads the next step should use.

    Args:
        limit: the most threads ever used (the kernel plan's).
        stat_path: the kernel's CPU accounting; where it is absent, the limit is always used.
        interval_s: the least time between two samples.
    """

    def __init__(self, limit: int, stat_path: Path = PROC_STAT, interval_s: float = INTERVAL_S):
        self.limit = limit
        self.current = limit
        self.interval_s = interval_s
        self._path = stat_path
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()
        self._next = time.monotonic() + self.interval_s

    def _sample(self) -> CpuSample | None:
        try:
            text = self._path.read_text()
        except OSError:
            return None
        t = os.times()
        return parse_stat(text, t.user + t.system)

    def threads(self) -> int:
        """The threads for the next step; samples the load at most every `interval_s` (otherwise it
        costs one clock read)."""
        if self._last is None or time.monotonic() < self._next:
            return self.current
        sample = self._sample()
        self._next = time.monotonic() + self.interval_s
        if sample is not None:
            if not spans_idle(self._last, sample, self._ticks):  # else a new window starts, the count kept
                other = other_busy_cores(self._last, sample, self._ticks)
                self.current = next_threads(self.current, self.limit, sample.cores, other)
            self._last = sample
        return self.current


# A step with this many tokens is prefill-heavy: its large matmuls are compute-bound and gain from
# every core, while small decode steps lose more to thread synchronisation than they gain.
PREFILL_STEP_TOKENS = 128


class StepThreads:
    """The threads each engine step runs on: a prefill-heavy step `prefill_threads`, any other
    `threads`; a step whose bits no thread count changes (the native one: `governed`) no more than the
    cores other processes leave free (`ThreadGovernor`), since its barriers would wait on descheduled
    threads."""

    def __init__(self, threads: int, prefill_threads: int, governed: bool):
        import torch

        self.threads, self.prefill_threads, self.governed = threads, prefill_threads, governed
        self.governor = ThreadGovernor(max(threads, prefill_threads))
        self.current = threads
        torch.set_num_threads(threads)

    def set_for(self, num_tokens: int) -> None:
        """Set torch's threads for a step of num_tokens tokens."""
        import torch

        threads = self.prefill_threads if num_tokens >= PREFILL_STEP_TOKENS else self.threads
        if self.governed:
            threads = min(threads, self.governor.threads())
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
