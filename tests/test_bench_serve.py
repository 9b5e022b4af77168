"""`stratum bench serve` and `compare`: seeded workloads, exact metric arithmetic, the SSE client against a mock
transport, and short real runs against the tiny-model server over both APIs."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from stratum.bench import compare, serve
from stratum.bench.serve import (BenchError, LoadConfig, RequestResult, Target, arrival_times, check_url,
                                 latency_stats, percentile, summarize)
from stratum.bench.workloads import CHARS_PER_TOKEN, WORKLOADS, WorkloadConfig, make_workload

# Small enough for the tiny model's 2048-token context (its 512-entry vocabulary is ~1.3 characters a token).
TINY_SIZES = ["--prefix-tokens", "100", "--long-tokens", "150", "--question-tokens", "12"]


def run_json(capsys, module, argv: list[str]) -> dict:
    assert module.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def tiny_args(server, *extra: str, api: str = "anthropic") -> list[str]:
    return ["--url", server.url, "--model", "tiny", "--api", api, "--no-progress", "--ignore-eos",
            "--timeout-s", "30", *TINY_SIZES, *extra]


# ---- workloads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_is_deterministic_for_a_seed(name):
    cfg = WorkloadConfig(num_requests=16, seed=7)
    assert make_workload(name, cfg) == make_workload(name, cfg)
    assert make_workload(name, cfg) != make_workload(name, WorkloadConfig(num_requests=16, seed=8))


def test_workload_shapes():
    n = 16
    unique = make_workload("unique", WorkloadConfig(num_requests=n))
    turns = [c.user_turns for c in unique.conversations]
    assert all(len(t) == 1 for t in turns) and len({t[0] for t in turns}) == n
    assert all(c.system is None for c in unique.conversations)
    assert all(15 * CHARS_PER_TOKEN <= len(t[0]) <= 35 * CHARS_PER_TOKEN for t in turns)  # ~24 tokens

    shared = make_workload("shared-prefix", WorkloadConfig(num_requests=n))
    systems = {c.system for c in shared.conversations}
    assert len(systems) == 1 and systems != {None}
    assert 600 * CHARS_PER_TOKEN <= len(systems.pop()) <= 650 * CHARS_PER_TOKEN  # ~600 tokens
    assert len({c.user_turns for c in shared.conversations}) == n

    multi = make_workload("multiturn", WorkloadConfig(num_requests=10, num_turns=4))
    assert [len(c.user_turns) for c in multi.conversations] == [4, 4, 2]
    assert multi.num_requests == 10

    mixed = make_workload("mixed-long", WorkloadConfig(num_requests=n))
    kinds = [c.kind for c in mixed.conversations]
    assert kinds[:8].count("long") == 1 and kinds[8:].count("long") == 1  # one in each run of 8
    for c in mixed.conversations:
        size = len(c.user_turns[0])
        if c.kind == "long":
            assert 1500 * CHARS_PER_TOKEN <= size <= 1550 * CHARS_PER_TOKEN and "Summarise" in c.user_turns[0]
        else:
            assert size < 40 * CHARS_PER_TOKEN


def test_unknown_workload_raises():
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope", WorkloadConfig())


# ---- metric arithmetic ---------------------------------------------------------------------------
def test_percentile_interpolates_linearly():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    assert latency_stats([0.001, 0.002, 0.003]) == {"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98}
    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def make_result(ttft: float, gaps: list[float], *, kind: str = "short", prompt: int = 100, cached: int = 0,
                ok: bool = True) -> RequestResult:
    """An ok request with chunks at ttft and then after each gap; one output token per chunk."""
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestResult(0, 0, kind, is_ok=ok, ttft_s=ttft, e2e_s=times[-1], chunk_times_s=times,
                         num_output_tokens=len(times), num_prompt_tokens=prompt, num_cached_tokens=cached,
                         has_usage=True, error=None if ok else "HTTP 500: boom")


def test_summarize_exact_figures():
    results = [
        make_result(0.100, [0.010, 0.010, 0.010], cached=50),  # 4 tokens, TPOT 10 ms, E2E 130 ms
        make_result(0.200, [0.020, 0.020, 0.020], kind="long", prompt=300),  # TPOT 20 ms, E2E 260 ms
        make_result(0.300, [0.030], cached=100),  # 2 tokens, TPOT 30 ms, E2E 330 ms
        RequestResult(0, 0, "short", error="HTTP 500: boom"),
        RequestResult(0, 0, "short", error="HTTP 500: boom"),
    ]
    s = summarize(results, duration_s=2.0, num_requests=8, slo_ttft_ms=250, slo_tpot_ms=25, num_cancelled=1)
    assert (s["completed"], s["failed"], s["cancelled"], s["not_issued"]) == (3, 2, 1, 2)
    assert s["error_samples"] == ["HTTP 500: boom"]
    assert s["output_tokens"] == 10 and s["output_tok_s"] == 5.0 and s["request_throughput"] == 1.5
    assert s["ttft_ms"] == {"mean": 200.0, "p50": 200.0, "p90": 280.0, "p99": 298.0}
    assert s["tpot_ms"] == {"mean": 20.0, "p50": 20.0, "p90": 28.0, "p99": 29.8}
    # ITL pools every gap: 10, 10, 10, 20, 20, 20, 30 ms.
    assert s["itl_ms"]["p50"] == 20.0 and s["itl_ms"]["mean"] == pytest.approx(120 / 7, abs=1e-3)
    assert s["e2e_ms"] == {"mean": 240.0, "p50": 260.0, "p90": 316.0, "p99": 328.6}
    assert s["ttft_jitter"] == 1.49
    assert (s["prompt_tokens"], s["cached_prompt_tokens"], s["cached_ratio"]) == (500, 150, 0.3)
    # TTFT <= 250 ms and TPOT <= 25 ms: the first two; the third misses both.
    assert s["goodput"] == {"slo_ttft_ms": 250, "slo_tpot_ms": 25, "requests": 2, "req_s": 1.0}
    assert s["short_ttft_ms"]["p50"] == 200.0 and s["long_ttft_ms"]["p50"] == 200.0
    assert s["short_ttft_ms"]["p99"] == 298.0


def test_summarize_without_slo_or_long_requests():
    s = summarize([make_result(0.1, [])], duration_s=1.0, num_requests=1)
    assert s["goodput"] is None and "short_ttft_ms" not in s
    assert s["tpot_ms"]["p50"] is None  # one token: no TPOT
    assert s["ttft_jitter"] == 1.0


def test_arrival_times():
    assert arrival_times(3, None, 1.0, 0) == [0.0, 0.0, 0.0]
    assert arrival_times(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    times = arrival_times(2000, 10.0, 1.0, seed=3)
    assert times == arrival_times(2000, 10.0, 1.0, seed=3) and times[0] == 0.0
    assert times[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    gaps = [b - a for a, b in zip(times, times[1:])]
    bursty = arrival_times(2000, 10.0, 0.25, seed=3)
    bursty_gaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert percentile(bursty_gaps, 50) < percentile(gaps, 50)  # same mean, more clumped


# ---- URLs --------------------------------------------------------------------------------------
def test_loopback_only_without_allow_remote(capsys):
    for url in ("http://127.0.0.1:8080", "http://127.3.4.5:1", "http://localhost:8080/v1", "http://[::1]:8080"):
        check_url(url, allow_remote=False)
    for url in ("http://10.0.0.5:8080", "http://example.com", "http://[2001:db8::1]:80"):
        with pytest.raises(BenchError, match="--allow-remote"):
            check_url(url, allow_remote=False)
        check_url(url, allow_remote=True)
    with pytest.raises(BenchError, match="not an http"):
        check_url("ftp://127.0.0.1/", allow_remote=True)
    assert serve.main(["--url", "http://192.0.2.7:8080", "--model", "m"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert compare.main(["--url", "http://127.0.0.1:1", "--url", "http://192.0.2.7:8080", "--model", "m"]) == 2

    from stratum.cli import main as cli_main

    assert cli_main(["bench", "serve", "--url", "http://192.0.2.7:8080", "--model", "m"]) == 2


# ---- the SSE client, against a mock transport ----------------------------------------------------
def sse_body(*events: tuple[str | None, object]) -> bytes:
    out = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        out.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")
    return "".join(out).encode()


def send(api: str, status: int, body: bytes) -> tuple[RequestResult, dict]:
    seen: dict = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestResult:
        r = RequestResult(0, 0, "short")
        target = Target("http://127.0.0.1:9", api, "m", max_tokens=8, is_ignore_eos=True)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await serve.send_request(client, target, "sys", [{"role": "user", "content": "hi"}], r)
        return r

    return asyncio.run(go()), seen


def test_anthropic_stream_usage_and_request():
    usage = {"input_tokens": 10, "output_tokens": 3, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0}
    body = sse_body(
        ("message_start", {"type": "message_start", "message": {"usage": dict(usage, output_tokens=0)}}),
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0}),
        *[("content_block_delta", {"type": "content_block_delta", "delta": {"type": "text_delta", "text": t}})
          for t in ("a", "b", "c")],
        ("message_delta", {"type": "message_delta", "usage": usage}),
        ("message_stop", {"type": "message_stop"}))
    r, seen = send("anthropic", 200, body)
    assert r.is_ok and r.text == "abc" and len(r.chunk_times_s) == 3 and len(r.itl_s) == 2
    assert (r.num_output_tokens, r.num_prompt_tokens, r.num_cached_tokens) == (3, 42, 32)
    assert seen["path"] == "/v1/messages"
    assert seen["body"] == {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                            "stream": True, "temperature": 0.0, "system": "sys", "ignore_eos": True}


def test_openai_stream_usage_and_request():
    chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              *[{"choices": [{"delta": {"content": t}}]} for t in ("x", "y")],
              {"choices": [{"delta": {}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2,
                                        "prompt_tokens_details": {"cached_tokens": 16}}}]
    body = b": ping\n\n" + sse_body(*[(None, c) for c in chunks], (None, "[DONE]"))
    r, seen = send("openai", 200, body)
    assert r.is_ok and r.text == "xy" and r.has_usage
    assert (r.num_output_tokens, r.num_prompt_tokens, r.num_cached_tokens) == (2, 40, 16)
    assert seen["path"] == "/v1/chat/completions"
    assert seen["body"]["messages"][0] == {"role": "system", "content": "sys"}
    assert seen["body"]["stream_options"] == {"include_usage": True} and seen["body"]["ignore_eos"] is True


def test_stream_without_usage_counts_chunks():
    body = sse_body(*[(None, {"choices": [{"delta": {"content": t}}]}) for t in "abcd"], (None, "[DONE]"))
    r, _ = send("openai", 200, body)
    assert r.is_ok and not r.has_usage and r.num_output_tokens == 4


@pytest.mark.parametrize("status, body, error", [
    (529, b'{"type":"error","error":{"type":"overloaded_error"}}', "HTTP 529"),
    (200, sse_body(("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})), "boom"),
    (200, sse_body(("content_block_delta", {"type": "content_block_delta",
                                            "delta": {"type": "text_delta", "text": "a"}})), "ended before"),
    (200, sse_body(("message_stop", {"type": "message_stop"})), "empty reply"),
])
def test_stream_failures_are_recorded(status, body, error):
    r, _ = send("anthropic", status, body)
    assert not r.is_ok and error in r.error


# ---- real runs against the tiny server -----------------------------------------------------------
@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_short_run_against_tiny_server(tiny_server, capsys, api, tmp_path):
    out = tmp_path / "result.json"
    doc = run_json(capsys, serve, tiny_args(tiny_server, "--workload", "unique", "--num-requests", "6",
                                            "--concurrency", "3", "--max-tokens", "8", "--output", str(out),
                                            "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", api=api))
    assert json.loads(out.read_text()) == doc
    assert doc["completed"] == 6 and doc["failed"] == 0 and doc["error_samples"] == []
    assert doc["config"]["api"] == api and doc["config"]["concurrency"] == 3
    assert doc["output_tokens"] == 6 * 8 and doc["requests_without_usage"] == 0
    assert doc["prompt_tokens"] > 6 * 12 and doc["output_tok_s"] > 0 and doc["duration_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = doc[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
    assert doc["ttft_ms"]["p50"] < doc["e2e_ms"]["p50"]
    assert doc["ttft_jitter"] >= 1.0
    assert doc["goodput"]["requests"] == 6


def test_shared_prefix_reports_cached_tokens_and_plots(tiny_server, capsys, tmp_path):
    doc = run_json(capsys, serve, tiny_args(tiny_server, "--workload", "shared-prefix", "--num-requests", "6",
                                            "--concurrency", "2", "--max-tokens", "4", "--plot", str(tmp_path),
                                            api="openai"))
    assert doc["completed"] == 6
    assert 0 < doc["cached_prompt_tokens"] < doc["prompt_tokens"] and doc["cached_ratio"] > 0
    assert (tmp_path / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_plots_throughput(tiny_server, capsys, tmp_path):
    doc = run_json(capsys, serve, tiny_args(tiny_server, "--workload", "unique", "--num-requests", "4",
                                            "--sweep", "1,2", "--max-tokens", "4", "--plot", str(tmp_path)))
    assert [lv["concurrency"] for lv in doc["sweep"]] == [1, 2]
    assert [lv["seed"] for lv in doc["sweep"]] == [0, 1]
    assert all(lv["completed"] == 4 for lv in doc["sweep"])
    for name in ("ttft_cdf.png", "throughput_vs_concurrency.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_multiturn_resends_history(tiny_server):
    target = Target(tiny_server.url, "anthropic", "tiny", max_tokens=4, is_ignore_eos=True)
    workload = make_workload("multiturn", WorkloadConfig(num_requests=6, num_turns=3, question_tokens=12))
    run = serve.run_level(target, workload, LoadConfig(concurrency=2, timeout_s=30), progress=False)
    assert run.summary["completed"] == 6
    for conv in (0, 1):
        turns = sorted((r for r in run.results if r.conversation == conv), key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2]
        assert turns[0].start_s < turns[0].start_s + turns[0].e2e_s <= turns[1].start_s  # sequential
        prompts = [r.num_prompt_tokens for r in turns]
        assert prompts[0] < prompts[1] < prompts[2]  # each turn carries the previous turns and replies


def test_mixed_long_reports_short_ttft(tiny_server, capsys):
    doc = run_json(capsys, serve, tiny_args(tiny_server, "--workload", "mixed-long", "--num-requests", "6",
                                            "--long-every", "3", "--concurrency", "3", "--max-tokens", "4"))
    assert doc["completed"] == 6
    assert doc["short_ttft_ms"]["p50"] > 0 and doc["long_ttft_ms"]["p50"] > 0


def test_duration_cap_and_timeout(tiny_server, capsys):
    doc = run_json(capsys, serve, tiny_args(tiny_server, "--workload", "unique", "--num-requests", "40",
                                            "--concurrency", "2", "--max-tokens", "300", "--duration-s", "1",
                                            "--num-warmups", "0"))
    assert doc["cancelled"] >= 1 and doc["duration_s"] == 1.0
    assert doc["completed"] + doc["failed"] + doc["cancelled"] + doc["not_issued"] == 40 and doc["not_issued"] > 0
    doc = run_json(capsys, serve, tiny_args(tiny_server, "--workload", "unique", "--num-requests", "2",
                                            "--concurrency", "2", "--max-tokens", "1000",
                                            "--timeout-s", "0.2", "--num-warmups", "0"))
    assert doc["failed"] == 2 and doc["error_samples"] == ["timeout after 0.2 s"]


def test_compare_two_urls(tiny_server, capsys, tmp_path):
    md = tmp_path / "compare.md"
    other = tiny_server.url.replace("127.0.0.1", "localhost")
    doc = run_json(capsys, compare, ["--url", tiny_server.url, "--url", other, "--label", "a", "--label", "b",
                                     *tiny_args(tiny_server, "--workload", "unique", "--num-requests", "3",
                                                "--concurrency", "3", "--max-tokens", "4",
                                                "--plot", str(tmp_path), "--markdown", str(md))[2:]])
    assert [t["label"] for t in doc["targets"]] == ["a", "b"]
    assert all(t["completed"] == 3 for t in doc["targets"])
    assert doc["ratios_vs_first"]["b"][0]["completed"] == 1.0
    table = md.read_text()
    assert "| metric | a | b | b / a |" in table and "TTFT p50 ms" in table
    assert (tmp_path / "ttft_cdf.png").exists()


def test_compare_in_rounds_alternates_the_targets_and_gives_each_rounds_ratios(tiny_server, capsys, tmp_path):
    """--rounds: each round on its own seed, the targets' figures over all the rounds, and each
    round's ratios against the first target with their median (the side by side on a drifting machine)."""
    md = tmp_path / "compare.md"
    other = tiny_server.url.replace("127.0.0.1", "localhost")
    doc = run_json(capsys, compare, ["--url", tiny_server.url, "--url", other, "--label", "a", "--label", "b",
                                     "--rounds", "3", "--markdown", str(md),
                                     *tiny_args(tiny_server, "--workload", "unique", "--num-requests", "2",
                                                "--concurrency", "1", "--max-tokens", "4")[2:]])
    assert all(t["completed"] == t["num_requests"] == 6 for t in doc["targets"])
    rounds = doc["by_round"]
    assert rounds["seeds"] == [0, 1, 2] and len(rounds["figures"]) == 3
    tok_s = rounds["ratios_vs_first"]["b"]["output_tok_s"]
    assert len(tok_s) == 3 and all(r > 0 for r in tok_s)
    assert rounds["median_ratios_vs_first"]["b"]["output_tok_s"] == round(sorted(tok_s)[1], 3)
    for f, r in zip(rounds["figures"], tok_s):
        assert r == round(f["b"]["output_tok_s"] / f["a"]["output_tok_s"], 3)
    table = md.read_text()
    assert "## By round" in table and "| median |" in table and "b / a tok/s" in table
    with pytest.raises(SystemExit):
        compare.main(["--url", tiny_server.url, "--rounds", "2", "--sweep", "1,2"])
