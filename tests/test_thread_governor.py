"""The native step's threads follow the machine's load (kernels/governor.py): the decision from given
/proc/stat samples, and the engine's greedy output unchanged whichever count the load picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stratum.kernels import native
from stratum.kernels.governor import ThreadGovernor, next_threads, other_busy_cores, parse_stat, spans_idle
from tests.factories import make_tiny_gguf

TICKS = 100


def _stat(busy: int, idle: int, cores: int = 2) -> str:
    """A /proc/stat with `busy` user jiffies and `idle` idle ones over `cores` cores."""
    per_core = "".join(f"cpu{i} {busy // cores} 0 0 {idle // cores} 0 0 0 0 0 0\n" for i in range(cores))
    return f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\n{per_core}intr 0\nctxt 0\n"


def _threads_after(busy_cores: float, own_cores: float = 0.0, current: int = 2, limit: int = 2) -> int:
    """One second on 2 cores: other processes and this one busy as given."""
    busy = round((busy_cores + own_cores) * TICKS)
    before = parse_stat(_stat(10_000, 10_000), own_s=5.0)
    after = parse_stat(_stat(10_000 + busy, 10_000 + 2 * TICKS - busy), own_s=5.0 + own_cores)
    return next_threads(current, limit, after.cores, other_busy_cores(before, after, TICKS))


def test_parse_reads_busy_total_and_cores():
    s = parse_stat("cpu  10 1 2 100 3 4 5 6 0 0\ncpu0 5 0 1 50 1 2 2 3 0 0\ncpu1 5 1 1 50 2 2 3 3 0 0\nintr 1\n",
                   own_s=0.5)
    assert (s.busy, s.total, s.cores, s.own_s) == (10 + 1 + 2 + 4 + 5 + 6, 131, 2, 0.5)


def test_a_quiet_machine_gets_the_plans_threads():
    assert _threads_after(0.0) == 2
    assert _threads_after(0.0, own_cores=2.0) == 2  # this process's own busy threads are not load


def test_other_processes_on_one_and_a_half_cores_leave_one_thread():
    assert _threads_after(1.5) == 1
    assert _threads_after(2.0, current=1) == 1  # never below one
    assert _threads_after(0.0, limit=1) == 1  # never above the plan's


def test_hysteresis_keeps_the_count_near_a_boundary():
    assert _threads_after(0.4, current=1) == 1  # 1.6 free: not yet enough to add a thread
    assert _threads_after(0.2, current=1) == 2
    assert _threads_after(0.7, current=2) == 2  # 1.3 free: not yet few enough to drop one
    assert _threads_after(0.8, current=2) == 1


def test_without_proc_stat_the_plans_threads_stay(tmp_path):
    governor = ThreadGovernor(2, stat_path=tmp_path / "absent", interval_s=0)
    assert [governor.threads() for _ in range(3)] == [2, 2, 2]


def test_a_window_over_an_idle_engine_keeps_the_count_and_starts_anew(tmp_path):
    """Other processes busy on both cores while the engine sat idle (a peer server's turn in a
    benchmark): the first step after it keeps the engine's threads, and the next window, the load
    of now, decides."""
    idle_before = parse_stat(_stat(10_000, 10_000), own_s=5.0)
    assert spans_idle(idle_before, parse_stat(_stat(10_000 + 6 * TICKS, 10_000), own_s=5.1), TICKS)  # 3 s, 0.1 s own
    assert not spans_idle(idle_before, parse_stat(_stat(10_000 + 6 * TICKS, 10_000), own_s=7.0), TICKS)  # 3 s stepping
    assert not spans_idle(idle_before, parse_stat(_stat(10_000 + TICKS, 10_000), own_s=5.0), TICKS)  # half a second

    stat = tmp_path / "stat"
    stat.write_text(_stat(10_000, 10_000))
    governor = ThreadGovernor(2, stat_path=stat, interval_s=0)
    stat.write_text(_stat(10_000 + 10 * TICKS, 10_000))  # 5 s of both cores busy, not by this process
    assert governor.threads() == 2
    stat.write_text(_stat(10_000 + 10 * TICKS + 40, 10_000 + 10))  # then a quarter second at 1.6 cores
    assert governor.threads() == 1


class _Load:
    """A /proc/stat the test advances: a quarter second on 2 cores per step, other processes busy as given."""

    def __init__(self, path: Path):
        self.path, self.busy, self.idle = path, 0, 0
        self.advance(0.0)

    def advance(self, other_cores: float) -> None:
        busy = round(other_cores * TICKS / 4)
        self.busy, self.idle = self.busy + busy, self.idle + 2 * TICKS // 4 - busy
        self.path.write_text(_stat(self.busy, self.idle))


@pytest.mark.skipif(not native.available(), reason="native kernels not built")
def test_greedy_output_is_the_same_whichever_threads_the_load_picks(tmp_path):
    from stratum.engine import LLM
    from stratum.engine.sampling_params import SamplingParams

    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    results = {}
    for other in (0.0, 1.5):
        engine = LLM(str(path), native_step=True, num_threads=2, num_kv_blocks=128, block_size=4, dtype="float32",
                     int4_max_tokens=0, enable_prefix_cache=False).engine
        load = _Load(tmp_path / "stat")
        engine.threads.governor = ThreadGovernor(2, stat_path=load.path, interval_s=0)
        seqs = [engine.add_request(engine.tokenizer.encode(p),
                                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, return_logits=True),
                                   request_id=p)
                for p in ("The capital of Japan is", "def add(a, b):", "Once upon a time")]
        used = set()
        while engine.has_unfinished():
            load.advance(other)
            engine.step()
            used.add(torch.get_num_threads())
        results[other] = used, seqs
    (quiet_threads, quiet), (busy_threads, busy) = results[0.0], results[1.5]
    assert quiet_threads == {2} and busy_threads == {1}
    for a, b in zip(quiet, busy):
        assert a.output_token_ids == b.output_token_ids
        assert all(torch.equal(a.readouts.logits[p], b.readouts.logits[p]) for p in a.readouts.logits)
