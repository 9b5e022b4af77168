"""`stratum chat`: streams answers in the terminal and prints each one's measured cost."""

from __future__ import annotations

import os
import re
import subprocess
import sys

COST = re.compile(r"^\[cache_hit_ratio=[0-9.]+,prefill_latency_us=\d+.* \| \$[0-9.]+ \| "
                  r"(\d+) prompt tokens \((\d+) cached\) "
                  r"\+ (\d+) output in [0-9.]+s", re.M)


def chat(*args: str, stdin: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STRATUM_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "stratum.cli", "chat", "--max-tokens", "8", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env)


def test_chat_with_a_running_server_keeps_the_conversation(tiny_server):
    r = chat("--url", tiny_server.url, stdin="hello there\nand again\n/reset\nnew start\n/exit\n")
    assert r.returncode == 0, r.stderr
    lines = COST.findall(r.stdout)
    assert len(lines) == 3, r.stdout
    (p1, _, o1), (p2, c2, _), (p3, _, _) = [tuple(map(int, x)) for x in lines]
    assert p2 > p1 + o1  # the second turn carries the first one
    assert int(c2) > 0  # and reads the first turn's blocks from the cache
    assert p3 < p2 and "[conversation cleared]" in r.stdout


def test_chat_starts_a_server_of_its_own(tiny_model_dir):
    r = chat("--model", str(tiny_model_dir), stdin="hi\n")
    assert r.returncode == 0, r.stderr
    assert len(COST.findall(r.stdout)) == 1, r.stdout + r.stderr
