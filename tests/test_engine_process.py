"""The engine in a process of its own: the wire format round-trips, and a request served through the
process gives the same tokens as the offline engine, with the text assembled from deltas equal to
the engine's own."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from stratum.engine import LLM, EngineConfig, RequestOutput, RequestStats, SamplingParams
from stratum.engine.client import EngineSnapshot, KVBlocks
from stratum.engine.process import (
    _decode_event, decode_command, decode_info, decode_snapshot, encode_command, encode_event, encode_info,
    encode_snapshot, start_process_engine,
)
from stratum.engine.request import CachePolicy


def wire(obj):
    """Through msgpack and back, as the pipe carries it."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)


def stats() -> RequestStats:
    return RequestStats(12, 4, 8, 0, 3, 0, 1.5, 1.6, 1.7, 1.7, 1.9, [1.7, 1.8, 1.9], 0.25, 2, 1, 4096, 0)


def test_outputs_round_trip_and_deltas_accumulate():
    partial: dict = {}
    first = RequestOutput("r", "Hel", [5, 6], "Hel", [5, 6], False, stats=stats(), state="prefill_complete")
    second = RequestOutput("r", "lo", [7], "Hello", [5, 6, 7], False, state="decode_step_2", kv_cache_efficiency=0.5)
    last = RequestOutput("r", "!", [8], "Hello!", [5, 6, 7, 8], True, "stop", 2, stats(), None, "finished", 0.5)
    got = [_decode_event(wire(encode_event(("out", o))), partial)[1] for o in (first, second, last)]
    assert got == [first, second, last]
    assert isinstance(got[0].stats, RequestStats) and got[0].stats.token_times == [1.7, 1.8, 1.9]
    assert wire(encode_event(("out", second)))[1][3] is None  # a running output sends its deltas only
    assert partial == {}  # forgotten once finished


def test_snapshot_command_and_info_round_trip(tiny_model_dir):
    snap = EngineSnapshot(alive=True, mode="basic", degraded_reason="x", num_running=2, num_waiting=1,
                          kv_blocks=KVBlocks(64, 10, 4, 50), num_preemptions=3, num_steps=9, overhead_ratio=0.1,
                          mean_step_s=0.02, threads=1, rss_mb=12.5)
    assert decode_snapshot(wire(encode_snapshot(snap))) == snap
    sampling = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=3, seed=11, stop=["\n"], stop_token_ids=[2])
    command = ("add", "r1", [1, 2, 3], sampling, {"priority": -1, "cache_policy": CachePolicy(pin_ttl_s=5.0),
                                                  "pin_prefixes": [(16, 300.0)], "tool_marker": "<tool_call>",
                                                  "low_latency": True, "cache_salt": "tenant"})
    assert decode_command(wire(encode_command(command))) == command
    assert decode_command(wire(encode_command(("abort", "r1")))) == ("abort", "r1")
    llm = LLM(str(tiny_model_dir), num_kv_blocks=32)
    from stratum.engine.client import EngineInfo

    info = EngineInfo.of(llm.engine)
    assert decode_info(wire(encode_info(info))) == info


def test_an_aborted_request_ends_with_a_last_output(tiny_model_dir):
    """The loop emits an aborted request's last output, so the side that assembles deltas forgets it."""
    from stratum.engine.client import EngineLoop

    emitted: list = []
    loop = EngineLoop(LLM(str(tiny_model_dir), num_kv_blocks=32).engine, emitted.extend)
    loop.submit(("add", "a1", [1, 5, 9], SamplingParams(max_tokens=50, ignore_eos=True), {}))
    loop._once()
    loop._once()
    loop.submit(("abort", "a1"))
    loop._once()
    last = [e[1] for e in emitted if e[0] == "out"][-1]
    assert last.request_id == "a1" and last.finished and last.finish_reason == "abort"
    assert emitted[-1][0] == "snapshot" and emitted[-1][1].kv_blocks.in_use == 0


@pytest.fixture(scope="module")
def process_client(tiny_model_dir):
    client = start_process_engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, num_threads=1))
    yield client
    client.shutdown()


def test_process_engine_serves_what_the_offline_engine_computes(tiny_model_dir, process_client):
    assert process_client.engine_pid != os.getpid()
    prompts = [[1, 5, 9, 13, 17], [1, 200, 201, 202, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    offline = LLM(str(tiny_model_dir), num_kv_blocks=64, num_threads=1).generate(prompts, params)

    async def serve():
        async def one(i, ids):
            stream = process_client.submit(ids, params, request_id=f"p{i}")
            deltas, last = [], None
            async for out in stream:
                deltas.append(out.delta_text)
                assert out.text == "".join(deltas)  # assembled on this side from the deltas
                last = out
                if out.finished:
                    break
            return last
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

    served = asyncio.run(serve())
    for got, want in zip(served, offline):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.stats.num_prompt_tokens == want.stats.num_prompt_tokens
    assert process_client.snapshot.alive and process_client.snapshot.kv_blocks.in_use == 0


def test_engine_process_exits_when_shut_down(tiny_model_dir):
    client = start_process_engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, num_threads=1))
    pid = client.engine_pid
    client.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: gone, not a zombie
