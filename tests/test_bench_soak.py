"""`stratum bench soak`: the RSS arithmetic and the outcome tally, and a short real soak against the tiny-model
server (both APIs, streamed and not, disconnects, probes, the idle KV check)."""

from __future__ import annotations

import json
import random

import pytest

from stratum.bench import soak
from stratum.bench.soak import Outcome, Probe, Tally, growth_pct, make_prompt, rss_after
from tests.conftest import ServerProcess


def test_growth_pct():
    assert growth_pct(1000.0, 1050.0) == 5.0
    assert growth_pct(927.0, 1640.0) == 76.91  # a 15-minute soak that leaked
    assert growth_pct(1000.0, 990.0) == -1.0
    assert growth_pct(None, 1000.0) is None and growth_pct(1000.0, None) is None and growth_pct(0.0, 1.0) is None


def test_rss_after_takes_the_first_sample_at_or_after():
    samples = [{"t_s": t, "total_mb": mb} for t, mb in [(0.0, 900.0), (119.9, 950.0), (120.0, None),
                                                        (150.0, 1000.0), (180.0, 1010.0)]]
    assert rss_after(samples, 120.0) == 1000.0  # 120.0 has no reading
    assert rss_after(samples, 0.0) == 900.0
    assert rss_after(samples, 200.0) is None


def test_tally_counts_each_outcome_apart():
    t = Tally()
    for o in [Outcome("ok", num_output_tokens=7), Outcome("ok", num_output_tokens=3), Outcome("rejected", key="529"),
              Outcome("disconnected"), Outcome("failed", "HTTP 500: x", "500"), Outcome("failed", "HTTP 500: x", "500"),
              Outcome("failed", "stream ended before its final event", "stream")]:
        t.add(o)
    assert (t.requests, t.output_tokens, t.rejected, t.disconnects, t.failures) == (2, 10, 1, 1, 3)
    assert t.failures_by_status == {"500": 2, "stream": 1}
    assert t.failure_samples == ["HTTP 500: x", "stream ended before its final event"]  # distinct only


def test_probe_compares_with_the_first_text():
    p = Probe()
    for text in ["a", "a", "b", "c", "a"]:
        p.add(text)
    assert (p.count, p.matched, p.mismatched, p.first_text, p.first_mismatch) == (5, 3, 2, "a", "b")


def test_prompts_mix_the_shared_prefix_and_unique_texts():
    rng = random.Random(0)
    prompts = [make_prompt(rng, "SYSTEM", 300, 600) for _ in range(200)]
    shared = [m for system, m in prompts if system == "SYSTEM"]
    unique = [m[0]["content"] for system, m in prompts if system is None]
    assert 60 < len(shared) < 140 and len(shared) + len(unique) == 200
    assert len(set(unique)) == len(unique)
    assert max(len(u) for u in unique) > 4 * len(min(unique, key=len))  # lengths vary widely


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir):
    """A server of its own: a soak fills the prefix cache, which other tests' block counts must not inherit."""
    server = ServerProcess(str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-mb", "8").wait_ready()
    yield server
    server.stop()


def test_soak_against_a_tiny_server(soak_server, tmp_path, capsys):
    out = tmp_path / "soak.json"
    argv = ["--url", soak_server.url, "--pid", str(soak_server.proc.pid), "--model", "tiny", "--clients", "2",
            "--duration-s", "6", "--sample-every-s", "2", "--probe-every-s", "2", "--max-prompt-tokens", "100",
            "--max-tokens", "32", "--disconnect-fraction", "0.3", "--timeout-s", "60", "--no-progress",
            "--out", str(out)]
    assert soak.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == json.loads(out.read_text())
    assert doc["failures"] == 0, (doc["failure_samples"], soak_server.output())
    assert doc["requests"] > 0 and doc["output_tokens"] > 0
    assert doc["disconnects"] > 0  # seed 0: client 1's 4th request hangs up after its first event
    assert doc["probe"]["count"] >= 2 and doc["probe"]["mismatched"] == 0
    assert doc["kv_leaked"] == 0 and doc["kv_blocks_end"]["total"] > 0
    assert len(doc["rss_mb"]) >= 3 and all(s["total_mb"] > 0 for s in doc["rss_mb"])
    assert doc["rss_at_2min_mb"] is None and doc["rss_growth_pct"] is None  # shorter than 2 minutes
    assert doc["rss_end_mb"] == doc["rss_mb"][-1]["total_mb"]
